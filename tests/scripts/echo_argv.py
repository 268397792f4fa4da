"""Each rank prints what it was given: `ARGV {"rank", "argv", "env": $HVDTRAIN_TEST, "cwd"}` on stdout, then
`rank N says hi on stderr` on stderr.

Each line goes out in a single write(): mpirun tags every chunk it reads from a rank, so a line written in pieces
(print() writes the text and the newline apart when stdout is unbuffered) can come out spliced with another
rank's or stream's line (seen: `[1]<stderr>:rank 1 says hi on stderrARGV {"rank": 0, ...}`). One write per line
keeps every line whole, whatever the ranks' timing: no sleeps needed to space them out.
"""

import json
import os
import sys

import horovod.torch as hvd


def say(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


hvd.init()
say(sys.stdout.fileno(), "ARGV " + json.dumps({"rank": hvd.rank(), "argv": sys.argv[1:],
                                                "env": os.environ.get("HVDTRAIN_TEST"), "cwd": os.getcwd()}))
say(sys.stderr.fileno(), f"rank {hvd.rank()} says hi on stderr")
