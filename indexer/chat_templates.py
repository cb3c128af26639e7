"""Chat templates as vLLM resolves and inspects them: loading one from the configuration (text or
file), the variables a template reads (vLLM drops request kwargs a template cannot use), and the
content format it expects (detected from the template's Jinja AST, as ``vllm/renderers/hf.py``
does).
"""

from __future__ import annotations

import inspect
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, Final

from indexer.chat_messages import ContentFormat
from indexer.errors import TokenizationError

logger = logging.getLogger(__name__)

_JINJA_CHARS: Final = frozenset("{}\n")


def load_chat_template(value: str | None, model: str) -> str | None:
    # vLLM `load_chat_template`: a readable file wins, otherwise the value is the template
    # itself, unless it has no Jinja characters at all and so must have meant a path.
    if value is None:
        return None
    try:
        path = Path(value).expanduser()
        if path.is_file():
            return path.read_text()
    except OSError:
        pass
    if not _JINJA_CHARS.intersection(value):
        raise TokenizationError(
            f"model {model!r}: chat_template {value!r} looks like a file path, but no such file "
            "exists; give the path of a Jinja template file or the template text itself"
        )
    return value


@lru_cache(maxsize=64)
def _parse_template(template: str) -> Any | None:
    # The same Jinja environment (and extensions, e.g. `{% generation %}`) transformers renders with.
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(template).environment.parse(template)
    except Exception:
        logger.warning("cannot parse a chat template to inspect it", exc_info=True)
        return None


@lru_cache(maxsize=64)
def template_variables(template: str) -> frozenset[str] | None:
    """The variables a template reads from its context (None when it cannot be parsed)."""
    ast = _parse_template(template)
    if ast is None:
        return None
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(ast))


@lru_cache(maxsize=1)
def apply_chat_template_params() -> frozenset[str]:
    from transformers import PreTrainedTokenizerBase

    parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    variadic = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    return frozenset(p.name for p in parameters if p.kind not in variadic and p.name != "self")


@lru_cache(maxsize=64)
def template_content_format(template: str) -> ContentFormat:
    """ "openai" when the template loops over a message's content, else "string".

    The same rule as vLLM's ``_detect_content_format`` (``vllm/renderers/hf.py``): find the names
    bound to ``messages`` (directly, by ``{% set %}``, through filters, tests or slices), the loop
    variables iterating over them, and then any loop over ``<message>['content']`` or
    ``<message>.content``. A template that cannot be parsed counts as "string", vLLM's default.
    """
    import jinja2.nodes as nodes

    ast = _parse_template(template)
    if ast is None:
        return "string"

    def reads(node: Any, name: str, key: str | None = None) -> bool:
        if isinstance(node, nodes.Filter):
            return node.node is not None and reads(node.node, name, key)
        if isinstance(node, nodes.Test):
            return reads(node.node, name, key)
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            return reads(node.node, name, key)
        if key is None:
            return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name
        if isinstance(node, nodes.Getitem):
            return (
                reads(node.node, name)
                and isinstance(node.arg, nodes.Const)
                and node.arg.value == key
            )
        if isinstance(node, nodes.Getattr):
            return reads(node.node, name) and node.attr == key
        return False

    message_lists = {"messages"}
    pending = ["messages"]
    while pending:
        source = pending.pop()
        for assign in ast.find_all(nodes.Assign):
            target = assign.target
            if (
                isinstance(target, nodes.Name)
                and target.name not in message_lists
                and reads(assign.node, source)
            ):
                message_lists.add(target.name)
                pending.append(target.name)
    loops = list(ast.find_all(nodes.For))
    message_names = {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, nodes.Name)
        and any(reads(loop.iter, name) for name in message_lists)
    }
    for loop in loops:
        if any(reads(loop.iter, name, "content") for name in message_names):
            return "openai"
    return "string"
