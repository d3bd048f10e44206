# SPDX-License-Identifier: Apache-2.0
"""``python -m trtllm_vtoken.cli`` = ``vtoken``."""

import sys

from trtllm_vtoken.cli import main

sys.exit(main())
