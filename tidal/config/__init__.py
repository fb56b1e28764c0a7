"""tidal's configuration: typed sections, flat flags, one validation pass, ``tidal explain``.

    cfg, prov = parse(argv)               # flags, --config FILE.yaml, --preset NAME
    cfg = resolve(cfg, prov, env)         # every rule; derived values recorded in prov
    print(explain(cfg, prov, env))        # what `tidal explain` prints; nothing is started

``Environment`` describes the machine (``Environment.detect()``), and ``split_assumptions(argv)``
takes explain's ``--assume-gpus 8 --assume-gpu-memory 80GiB`` style flags out of ``argv``.
"""

from tidal.config.args import add_arguments, build_parser, config_from_dict, fields, flag_of, parse, to_yaml
from tidal.config.environment import Environment, format_bytes, parse_size, split_assumptions
from tidal.config.explain import derived_quantities, explain, explain_argv
from tidal.config.provenance import Provenance, Source
from tidal.config.removed import REMOVED, RemovedFlag, find_removed
from tidal.config.schema import SECTIONS, TidalConfig
from tidal.config.validate import RULES, resolve

__all__ = [
    "REMOVED",
    "RULES",
    "SECTIONS",
    "Environment",
    "Provenance",
    "RemovedFlag",
    "Source",
    "TidalConfig",
    "add_arguments",
    "build_parser",
    "config_from_dict",
    "derived_quantities",
    "explain",
    "explain_argv",
    "fields",
    "find_removed",
    "flag_of",
    "format_bytes",
    "parse",
    "parse_size",
    "resolve",
    "split_assumptions",
    "to_yaml",
]
