"""The scalar-argument parsers the ops use (ops/_call.py), for the layers
above them (the modules' constructors and wrappers): ``as_int`` and
``as_float`` turn a Python number into the int / float C takes, or raise a
TypeError / ValueError naming the op and the argument (a string, a
fractional count, a number outside int64, a bool read as 0 / 1) instead of
truncating it or failing later with a foreign message.  ``as_float`` is
the one reader of real-number arguments for ops and every layer above
them: its keywords ask for a rule (``finite``, ``minimum`` / ``above``,
``maximum``), so no caller needs its own "a real number, not a bool" test
(seqfuse.common, below ops, and seqfuse.data, which depends on nothing of
seqfuse's, cannot import it; optim/adamw.py's hyper-parameter checks still
word their own).  ``exact_int`` is the strict reading (an
integer of any kind, else None: no bool, no float) for callers that word
their own message; ``as_max_norm`` reads a gradient-clipping bound
(optim's and distributed's clip_grad_norm_: as_float, >= 0).
``increment_versions`` bumps the version counters of tensors written in
place through C, so that autograd sees those writes as it sees torch's
own."""
from ._call import as_float, as_int, as_max_norm, exact_int, increment_versions

__all__ = ["as_float", "as_int", "as_max_norm", "exact_int", "increment_versions"]
