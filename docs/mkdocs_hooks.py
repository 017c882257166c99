"""MkDocs hook: build the site from ``docs/`` itself, where this config file lives.

MkDocs refuses a ``docs_dir`` equal to the config file's folder at validation time, but the
repository keeps its top level fixed (no ``mkdocs.yml`` there) and every page is a plain
``docs/<topic>.md``. The config names a child folder to pass validation; this hook then
points ``docs_dir`` at ``docs/`` before any file is collected. The config file and this
hook are left out of the site by ``exclude_docs``.
"""

from __future__ import annotations

import os
from typing import Any


def on_config(config: Any) -> Any:
    config["docs_dir"] = os.path.dirname(os.path.abspath(config.config_file_path))
    return config
