"""The scalar-argument parsers the ops use (ops/_call.py), for the layers
above them (the modules' constructors and wrappers): ``as_int`` and
``as_float`` turn a Python number into the int / float C takes, or raise a
TypeError / ValueError naming the op and the argument (a string, a
fractional count, a number outside int64) instead of truncating it or
failing later with a foreign message.  ``increment_versions`` bumps the
version counters of tensors written in place through C, so that autograd
sees those writes as it sees torch's own."""
from ._call import as_float, as_int, increment_versions

__all__ = ["as_float", "as_int", "increment_versions"]
