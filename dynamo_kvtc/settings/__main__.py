"""``python -m dynamo_kvtc.settings [--check DOC | --write DOC]``: the settings reference (:mod:`.reference`)."""

import sys

from .reference import main

sys.exit(main())
