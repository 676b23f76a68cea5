"""Log a line once per process: how seqfuse names a route it took instead of
the one a caller might expect (a fallback, a declined fusion, a host read)
without repeating it at every step."""
import logging

_noted = set()  # (logger name, text, args) of the lines logged so far


def note_once(logger, text, *args, level=logging.INFO):
    """Log ``text % args`` to ``logger`` (a logging.Logger) at ``level`` the
    first time this logger, text and arguments are noted in the process;
    later notes of the same say nothing.  Returns whether it logged."""
    key = (logger.name, text, args)
    if key in _noted:
        return False
    _noted.add(key)
    logger.log(level, text, *args)
    return True
