"""`python -m jaxpar.core.config`: the schema's command line (jaxpar/core/config/schema.py main)."""

import sys

from jaxpar.core.config.schema import main

sys.exit(main())
