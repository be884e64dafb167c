"""NightVision: black-box inference of an LLM's hidden dimension, depth and parameter count.

Where the paper is (each ``__init__`` says more; the README's figure and equation indexes map every label to a
function): ``oracle`` the API the attack talks to (§2, §5's cost), its backends and the defence layer;
``phase1`` the hidden dimension d (§4.1, App. B.1-B.2, Algs. 1-2); ``phase2`` depth L and parameters P from timing
(§4.2, App. B.3, App. D, Eqs. 2-3, 6-11); ``theory`` Theorem 1, Corollary 1 and the Carlini et al. baseline (§4.1.2,
§5.2, App. F); ``models`` loading and the packaged models; ``plots`` the figures. Modules: ``overall`` (§5.1, the
attacked model), ``validation`` (§5.1-5.3 across models), ``defences`` (not in the paper: what stops the attack),
``live`` and ``cli`` (the attack on an endpoint), ``params``/``profile``/``stage`` (params.yaml and the DVC stages)."""

from pathlib import Path

from nv.errors import NVError

__all__ = ["NVError", "project_root"]


def project_root(root: str | Path = ".") -> Path:
    """The project folder (the one holding params.yaml) from a notebook's ``root`` parameter: DVC and
    papermill pass it; JupyterLab starts the kernel in ``notebooks/``, whose parent is the project."""
    root = Path(root).resolve()
    if not (root / "params.yaml").is_file() and (root.parent / "params.yaml").is_file():
        return root.parent
    return root
