"""Oracle backends behind one interface (see ``nv.oracle.base``)."""

from nv.oracle.base import LOGPROB_MODES, Cost, Oracle, Samples, TimedCall
from nv.oracle.http import HTTPOracle
from nv.oracle.simulator import Simulator

__all__ = ["LOGPROB_MODES", "Cost", "HTTPOracle", "Oracle", "Samples", "Simulator", "TimedCall"]
