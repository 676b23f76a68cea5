"""The first check of every module's forward: the input is a tensor with
enough dimensions and the right last dimension, or a TypeError / ValueError
that names the module, the argument and the rule (torch.nn's modules raise
TypeError for a non-tensor input too; without this check a list or None
would surface as an AttributeError from deep inside the forward)."""
import torch


def check_input(cls, x, features=None, what=None, name="input", min_dim=1):
    """Raise unless ``x`` is a tensor of at least ``min_dim`` dimensions whose
    last dimension is ``features`` (the module's ``what``, e.g. in_features;
    not checked when None)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{cls}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(f"{cls}: {name} must have at least {min_dim} dimension(s), got shape {tuple(x.shape)}")
    if features is not None and x.shape[-1] != features:
        raise ValueError(f"{cls}: {name}'s last dimension must be {what} = {features}, got shape "
                         f"{tuple(x.shape)}")
