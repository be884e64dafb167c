"""NightVision: black-box inference of an LLM's hidden dimension, depth and parameter count."""

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
