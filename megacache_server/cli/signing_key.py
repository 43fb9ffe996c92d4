"""`megacache-server signing-key generate|public`: the Ed25519 key pair that signs
manifests. They touch no storage: the server keeps the private key, clients the public one."""

from __future__ import annotations

import argparse
import sys

from megacache_client.wire.exitcodes import ExitCode
from megacache_client.wire.signing import SigningError
from megacache_server.cli.runner import CommandFailed
from megacache_server.service.security.signing import signer_for, write_new_key


def cmd_key_generate(args: argparse.Namespace) -> int:
    """The server keeps the private key, clients the public one (printed on stdout)."""
    try:
        public = write_new_key(args.out)
    except FileExistsError:
        raise CommandFailed(ExitCode.PROBLEM,
                            f"{args.out} exists; not overwriting a key") from None
    except (OSError, SigningError) as exc:
        raise CommandFailed(ExitCode.PROBLEM, str(exc)) from None
    print(f"wrote private key {args.out} (mode 0600): set "
          f"MEGACACHE_SIGNING_KEY_FILE={args.out} on the server; give clients "
          "MEGACACHE_VERIFY_KEY=<the line on stdout>", file=sys.stderr)
    print(public)
    return ExitCode.OK


def cmd_key_public(args: argparse.Namespace) -> int:
    """The public key of a private key file, to give clients again."""
    try:
        public = signer_for(args.key_file).public_key
    except (OSError, SigningError) as exc:
        raise CommandFailed(ExitCode.PROBLEM, str(exc)) from None
    print(public)
    return ExitCode.OK
