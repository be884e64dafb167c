"""The one exception type the command line and notebooks turn into a one-line message."""


class NVError(Exception):
    """Bad input or an unusable resource (model, endpoint, params, cache).

    The message names the problem in one line; entry points print it without a traceback.
    """
