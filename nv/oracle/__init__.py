"""The API the attack talks to (§2 threat model, §5 cost metric): one interface (``base.Oracle``:
sample, argmax, time_request; every call charged with §5's token formula) and its backends, the
white-box ``simulator`` over a local model (exact ``multinomial`` draws) and the ``http`` client of any
OpenAI-compatible endpoint with its append-only ``journal``; ``prompts``: chat formatting and cost.
Defences a provider can switch on: ``defence`` (``DefendedOracle``, a wrapper of any backend) and
``defence_proxy`` (the same knobs as a reverse proxy in front of a live server, ``nv defend``)."""

from nv.oracle.base import LOGPROB_MODES, Cost, Oracle, Samples, TimedCall
from nv.oracle.http import HTTPOracle
from nv.oracle.simulator import Simulator

__all__ = ["LOGPROB_MODES", "Cost", "HTTPOracle", "Oracle", "Samples", "Simulator", "TimedCall"]
