"""serve.py: the OpenAI-compatible HTTP server (dense_engine/server/), as `python serve.py --ckpt DIR` or
`dense-serve --ckpt DIR`."""

import sys

from dense_engine.server.serve import main

if __name__ == "__main__":
    sys.exit(main())
