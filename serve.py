"""serve.py: the OpenAI-compatible HTTP server (dense_engine/server/), as `python serve.py --ckpt DIR` or
`dense-serve --ckpt DIR`."""

import sys

from dense_engine.formats import preread

if __name__ == "__main__":
    preread.start_from_argv(sys.argv[1:])  # a GGUF file's blocks are read on a thread while torch is imported

from dense_engine.server.serve import main

if __name__ == "__main__":
    sys.exit(main())
