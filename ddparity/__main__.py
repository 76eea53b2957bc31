"""``python -m ddparity``: the ``ddparity`` command (also ``torchrun ... -m ddparity``)."""

from ddparity.cli import main

if __name__ == "__main__":  # not when a forkserver or spawned child imports it as __mp_main__
    raise SystemExit(main())
