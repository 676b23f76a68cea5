"""Transformer Engine's ``parameters_split`` for Linear and LayerNormLinear.

TE can keep the rows of one projection's weight (and bias) as several
parameters: MultiheadAttention with ``fuse_qkv_params=False`` (TE's
default) holds ``query_weight``, ``key_weight`` and ``value_weight`` instead
of one fused QKV weight.  Here the module still runs ONE GEMM: the forward
concatenates the pieces along dim 0 (a copy of the weight, a few
microseconds against the GEMM; its backward hands each piece its rows of
the weight gradient without a copy).  Under FP8 the concatenated weight is
a new tensor on every call; its FP8 cast is cached on the pieces' versions
(seqfuse.quantization's WeightQuantizer), so it is still cast once per
weight update.

``parameters_split`` is a dict (name -> rows, in order) or a list / tuple
of names (equal rows).  Trailing underscores are stripped and ``_weight`` /
``_bias`` appended: ("query_", "key_", "value_") gives ``query_weight`` and
so on.  Each piece is initialised on its own, in order, as TE initialises
its split parameters: ``init_method`` is called once per piece and sees
the piece's shape (an initialiser that reads the fan-out, such as Xavier's,
draws what TE draws); biases start at zero.
"""
import torch


def parse_split(cls, parameters_split, out_features):
    """[(name, rows)] from TE's ``parameters_split``, or None; a TypeError or
    ValueError naming the argument where it cannot describe out_features rows."""
    if parameters_split is None:
        return None
    if isinstance(parameters_split, dict):
        items = list(parameters_split.items())
        for name, rows in items:
            if not isinstance(rows, int) or isinstance(rows, bool) or rows <= 0:
                raise ValueError(f"{cls}: parameters_split[{name!r}] must be a positive number of rows, "
                                 f"got {rows!r}")
    elif isinstance(parameters_split, (list, tuple)):
        n = len(parameters_split)
        if n == 0 or out_features % n:
            raise ValueError(f"{cls}: parameters_split of {n} names must split out_features = "
                             f"{out_features} into equal parts")
        items = [(name, out_features // n) for name in parameters_split]
    else:
        raise TypeError(f"{cls}: parameters_split must be a dict (name -> rows) or a tuple of names, "
                        f"got {type(parameters_split).__name__}")
    for name, _ in items:
        if not isinstance(name, str) or not name.rstrip("_"):
            raise ValueError(f"{cls}: parameters_split names must be non-empty strings, got {name!r}")
    split = [(name.rstrip("_"), rows) for name, rows in items]
    names = [name for name, _ in split]
    if len(set(names)) != len(names):
        raise ValueError(f"{cls}: parameters_split names must be distinct, got {names}")
    if sum(rows for _, rows in split) != out_features:
        raise ValueError(f"{cls}: parameters_split rows {[r for _, r in split]} must add up to "
                         f"out_features = {out_features}")
    return split


def install_split(module, split):
    """Replace ``module.weight`` / ``module.bias`` by one parameter per piece,
    holding the rows they held."""
    weight, bias = module.weight, module.bias
    del module.weight
    del module.bias
    start = 0
    for name, rows in split:
        rows_of = slice(start, start + rows)
        module.register_parameter(f"{name}_weight", torch.nn.Parameter(weight.detach()[rows_of].clone()))
        module.register_parameter(f"{name}_bias", None if bias is None
                                  else torch.nn.Parameter(bias.detach()[rows_of].clone()))
        start += rows
    module.weight = module.bias = None  # plain attributes: "no single weight"
    module.parameters_split = split


@torch.no_grad()
def reset_split(module, init_piece):
    """Initialize the pieces as Transformer Engine initializes its split
    parameters: ``init_piece(piece)`` on each piece in order (an init_method
    that reads its tensor's shape sees the piece's, as in TE); biases zero."""
    for name, _ in module.parameters_split:
        init_piece(getattr(module, f"{name}_weight"))
        b = getattr(module, f"{name}_bias")
        if b is not None:
            b.zero_()


def weight_sources(module):
    """The parameters the GEMM's weight is made from: None when it is the
    module's own ``weight``, else the split pieces (the FP8 weight cache
    follows their versions)."""
    split = module.__dict__.get("parameters_split")  # (a plain attribute: install_split sets it)
    if not split:
        return None
    return tuple(getattr(module, f"{name}_weight") for name, _ in split)


def fused_params(module, cls):
    """(weight, bias) for the module's one GEMM: its own parameters, or the
    pieces concatenated (autograd routes the gradients back to them)."""
    # read from the instance dict: getattr on an nn.Module without the
    # attribute goes through Module.__getattr__ and an exception (~1 us)
    split = module.__dict__.get("parameters_split")
    if not split:
        return module.weight, module.bias
    weights = [getattr(module, f"{name}_weight") for name, _ in split]
    if any(hasattr(w, "main_grad") for w in weights):
        raise NotImplementedError(f"{cls}: main_grad (fused weight-gradient accumulation) on split "
                                  "parameters is not supported; use parameters_split=None")
    biases = [getattr(module, f"{name}_bias") for name, _ in split]
    bias = None if biases[0] is None else torch.cat(biases)
    return torch.cat(weights), bias
