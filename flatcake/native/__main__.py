"""``python -m flatcake.native [--json]``: print the state of each of FlatCake's C loops (native,
fallback and why, off) and the extension they come from; exit 0 when none fell back, else 1.

The loops are C in ``csrc/``, compiled at install into the extension ``flatcake._native``; their
registry is :mod:`flatcake.native.loops` (:func:`~flatcake.native.loops.main` is the command);
this module only gives the command its name.
"""

from flatcake.native.loops import main

if __name__ == "__main__":
    raise SystemExit(main())
