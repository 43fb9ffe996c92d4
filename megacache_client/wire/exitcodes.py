"""The exit codes of `megacache` and `megacache-server`: one scheme for both commands.

Scripts and supervisors (systemd, Kubernetes, CI) branch on these, so each kind of failure
has its own code and a code never changes meaning.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    #: the command ran and reports a finding: fsck problems, no such entry or token
    PROBLEM = 1
    #: bad command line: unknown flag, missing or malformed argument (argparse's own code)
    USAGE = 2
    #: the configuration cannot work: invalid setting, missing extra, unsafe exposure
    CONFIG = 3
    #: something needed is unreachable: the cache server (client), Redis or S3 (server)
    UNAVAILABLE = 4
    #: the service did not start: port taken, a worker failed during start-up
    STARTUP = 5


def describe() -> str:
    """The scheme as one line, for --help epilogs."""
    return ("exit codes: 0 ok, 1 problem found, 2 usage, 3 configuration, "
            "4 server/storage unreachable, 5 service failed to start")
