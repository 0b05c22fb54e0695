"""A griffe extension: ``Example:`` is a Google-style section, as ``Examples:`` is.

Napoleon (Sphinx's reader of Google-style docstrings) takes both headings; griffe, which
mkdocstrings uses, knows only the plural and renders the singular's ``>>>`` lines as prose. The
docstrings keep the heading they were written with, and the reference shows their examples as code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SINGULAR = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _SINGULAR.sub(r"\1Examples:", obj.docstring.value)
