"""Prints what a script sees of how it was started (argv, path[0], __file__, __name__, __spec__), that a
multiprocessing 'spawn' child can import __main__ and run a function defined in it, and that an atexit handler can
still pickle an object of a class defined in the script."""

import atexit
import json
import multiprocessing as mp
import pickle
import sys


class Point:
    pass


def pickle_at_exit() -> None:
    print(f"atexit pickled {len(pickle.dumps(Point()))} bytes", flush=True)


def square(x: int) -> int:
    return x * x


if __name__ == "__main__":
    atexit.register(pickle_at_exit)  # in this process only (a spawn child imports this file as __mp_main__)
    with mp.get_context("spawn").Pool(1) as pool:
        spawned = pool.map(square, [3])
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "file": __file__, "name": __name__,
                      "spec": repr(__spec__), "spawned": spawned}))
    if len(sys.argv) > 1 and sys.argv[1] == "interrupt":
        raise KeyboardInterrupt
