"""Oracle backends behind one interface (see ``nv.oracle.base``)."""

from nv.oracle.base import LOGPROB_MODES, Cost, Oracle, Samples, TimedCall
from nv.oracle.simulator import Simulator

__all__ = ["LOGPROB_MODES", "Cost", "Oracle", "Samples", "Simulator", "TimedCall"]
