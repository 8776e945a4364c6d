"""python -m dsflash.train OUT_DIR: train the demo model into OUT_DIR (see fit.RECIPE)."""

import json
import sys
from pathlib import Path

from dsflash.train.fit import train

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m dsflash.train OUT_DIR")
    print(json.dumps(train(Path(sys.argv[1])), indent=2))
