"""Griffe extension for the API reference: render the Sphinx roles of our docstrings
(``:class:`~dtensor_ema.ModelEMA```, ``:meth:`update```) as inline code, which is what they
mean, instead of printing the role markup. Referenced from ``docs/mkdocs.yml``."""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|meth|func|attr|mod|data|exc|obj|paramref):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)
