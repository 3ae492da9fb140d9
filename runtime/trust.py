"""What a deployment accepts from a bundle, said once on the command line of deepinfer-run and
deepinfer-serve and handed on to every follower rank:

    --verify-key FILE        refuse the bundle unless its signature (deepinfer-compile --sign-key) matches
    --native-regions refuse  refuse a bundle whose regions carry machine code (inductor, pjrt, neuron):
                             the bundle must be data (export regions), whatever its manifest says
"""

from dataclasses import dataclass
from pathlib import Path

import click


@dataclass(frozen=True)
class Trust:
    verify_key_file: Path | None = None
    native_regions: bool = True

    @classmethod
    def of_options(cls, verify_key: str | None, native_regions: str) -> "Trust":
        return cls(Path(verify_key) if verify_key else None, native_regions == "allow")

    def args(self) -> list[str]:
        """The same policy on a follower's command line."""
        key = ["--verify-key", str(self.verify_key_file)] if self.verify_key_file else []
        return [*key, "--native-regions", "allow" if self.native_regions else "refuse"]


def trust_options(command):
    """--verify-key and --native-regions on a command; it receives
    `verify_key` and `native_regions` (Trust.of_options makes the Trust)."""
    command = click.option("--native-regions", type=click.Choice(["allow", "refuse"]), default="allow", show_default=True,
                           help="refuse: run only bundles that carry no machine code (export regions)")(command)
    return click.option("--verify-key", type=click.Path(dir_okay=False),
                        help="deploy key file: refuse the bundle unless its signature (deepinfer-compile --sign-key) "
                             "matches")(command)
