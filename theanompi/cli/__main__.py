"""``python -m theanompi.cli``: the ``tmpi`` command."""

from theanompi.cli import main

main()
