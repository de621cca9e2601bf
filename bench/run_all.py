"""Run every benchmark in bench/ (``make bench``); each prints its own table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def main() -> int:
    here = Path(__file__).parent
    failed = []
    for script in sorted(here.glob("*.py")):
        if script.name == Path(__file__).name or script.name.startswith("_"):
            continue
        print(f"\n=== {script.name}", flush=True)
        if subprocess.run([sys.executable, str(script)]).returncode != 0:
            failed.append(script.name)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
