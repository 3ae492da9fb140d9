"""What a deployment accepts from a bundle, said once on the command line of deepinfer-run and
deepinfer-serve and handed on to every follower rank:

    --verify-key FILE          refuse the bundle unless its signature (deepinfer-compile --sign-key) matches
    --native-regions POLICY    whether regions that carry machine code (inductor, pjrt, neuron) may run:
        allow    any bundle's (deepinfer-run's default: you run what you compiled)
        signed   only a bundle whose signature --verify-key verified (deepinfer-serve's default: a server
                 loads bundles from shared storage, and whoever can write there could run code in it)
        refuse   none: the bundle must be data (export regions), whatever its manifest says

A native region is code: its bytes are executed as they are, and checksums only catch accidents
(anyone who can edit a bundle can recompute them). Only a signature says who built it.
"""

from dataclasses import dataclass
from pathlib import Path

import click

POLICIES = ("allow", "signed", "refuse")


@dataclass(frozen=True)
class Trust:
    verify_key_file: Path | None = None
    native_regions: str = "allow"  # one of POLICIES

    @classmethod
    def of_options(cls, verify_key: str | None, native_regions: str) -> "Trust":
        return cls(Path(verify_key) if verify_key else None, native_regions)

    def args(self) -> list[str]:
        """The same policy on a follower's command line."""
        key = ["--verify-key", str(self.verify_key_file)] if self.verify_key_file else []
        return [*key, "--native-regions", self.native_regions]

    def native_refusal(self, backends: list[str]) -> str | None:
        """Why a bundle whose regions of `backends` carry machine code may not run here (None: it may)."""
        what = f"the bundle's regions carry machine code ({', '.join(backends)} backend)"
        if self.native_regions == "refuse":
            return (f"{what}, and this deployment runs data-only bundles (--native-regions refuse). Compile it with "
                    "`--backend export`, or allow native regions for a bundle you trust.")
        if self.native_regions == "signed" and self.verify_key_file is None:
            return (f"{what}, which runs as it is, and nothing verified who built it: native regions run here only from "
                    "a signed bundle (--native-regions signed). Sign it when compiling (`deepinfer-compile RECIPE "
                    "--sign-key KEYFILE`) and pass `--verify-key KEYFILE`; or, for a bundle you built yourself, pass "
                    "`--native-regions allow`.")
        return None


def trust_options(default: str):
    """--verify-key and --native-regions (default `default`) on a command; it receives
    `verify_key` and `native_regions` (Trust.of_options makes the Trust)."""
    def decorate(command):
        command = click.option(
            "--native-regions", type=click.Choice(POLICIES), default=default, show_default=True,
            help="whether regions that carry machine code (inductor, pjrt, neuron: such a bundle is a program) may run: "
                 "allow any; signed: only in a bundle --verify-key verified; refuse: data-only bundles (export)")(command)
        return click.option("--verify-key", type=click.Path(dir_okay=False),
                            help="deploy key file: refuse the bundle unless its signature (deepinfer-compile --sign-key) "
                                 "matches")(command)
    return decorate
