"""``python -m kvlink.atom.serve <ATOM server arguments>``: ATOM's OpenAI server with the
kvlink backend registered in every process.

ATOM starts its engine cores and workers with ``spawn``; each child re-imports the main
module by name (``kvlink.atom.serve``), which imports ``kvlink.atom`` and so registers the
backend before ATOM's factory looks it up. (A package's ``__main__`` would not be re-imported
that way, which is why this is a module of its own.)"""

from __future__ import annotations

import kvlink.atom  # noqa: F401  (registers the backend in this process and every child)


def main() -> None:
    """Runs ATOM's server entry point, as ``python -m atom.entrypoints.openai_server`` does."""
    from atom.utils import envs, set_ulimit

    if envs.USE_ATOMESH_ENTRYPOINTS:
        from atom.entrypoints.atomesh.server import main as atom_main
    else:
        from atom.entrypoints.openai.api_server import main as atom_main
    set_ulimit()
    atom_main()


if __name__ == "__main__":
    main()
