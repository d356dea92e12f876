"""``python -m flatcake.native [--json]``: build FlatCake's C loops and print each one's state
(native, fallback and why, off, pending); exit 0 when none fell back, else 1.

The loops and their registry are :mod:`flatcake.native_loop` (:func:`~flatcake.native_loop.main`
is the command); this module only gives the command its name.
"""

from flatcake.native_loop import main

if __name__ == "__main__":
    raise SystemExit(main())
