"""YAML as a config's author means it: PyYAML follows YAML 1.1, where `4:00:00` (a Slurm time
limit) is the base-60 number 14400, `0123` (an account) the octal 83, `on` (a partition) true and
`2026-11-01` a date, and a key written twice keeps the later value in silence. Here those stay text
(as in YAML 1.2; a boolean setting still takes yes/no/on/off, see `coerce`) and a repeated key is an
error.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

# YAML 1.1's int and float patterns (PyYAML's resolver.py) less their base-60 forms and, for ints,
# the leading-zero octal: 0b.., 0x.., 1_000, 3.5, .inf and .nan are still numbers.
_INT = re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$")
_FLOAT = re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_REPLACED = (*_NUMBER_TAGS, "tag:yaml.org,2002:bool", "tag:yaml.org,2002:timestamp")


class StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` may be overridden by the keys beside it: that is its purpose
            key = self.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: SafeLoader's own error says so
                continue
            if repeated:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {str(key)[:40]!r} appears twice (the later would replace the earlier)", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)


StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _REPLACED]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
StrictLoader.add_implicit_resolver(_NUMBER_TAGS[0], _INT, list("-+0123456789"))
StrictLoader.add_implicit_resolver(_NUMBER_TAGS[1], _FLOAT, list("-+0123456789."))
StrictLoader.add_implicit_resolver("tag:yaml.org,2002:bool", _BOOL, list("tTfF"))


def load(text: str) -> Any:
    return yaml.load(text, Loader=StrictLoader)  # a SafeLoader: plain data only
