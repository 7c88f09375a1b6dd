"""The HF <-> Megatron weight mapping of a model family, as a table of rules.

A family writes its weights down as ``WeightRule``s: one Megatron tensor (full, TP-unsharded,
local-spec name) and the HF tensors it is made of, both named by patterns with ``{layer}`` and
``{expert}`` fields. ``WeightMap`` turns the table into the three conversions the checkpoint
converter, the loaders and the tests use:

- ``hf_group(name, hf)``: which HF tensors convert together (the Megatron tensor they make);
- ``hf_to_mcore(tensors, hf, partial=)``: HF tensors -> Megatron tensors;
- ``mcore_to_hf(tensors, hf, checkpoint_layout=)``: the inverse, tensor by tensor.

A rule joins its HF tensors into the Megatron one (``join``, by default stacked rows) and splits
it back (``split``, by default equal row blocks). A rule whose HF tensor holds every expert of a
layer stacked (transformers' module layout, ``hf_stacked``) maps one HF tensor onto one Megatron
tensor per expert. HF tensors outside the Megatron model are ``dropped`` (a vision tower) or
``kept`` (multi-token-prediction layers, which a converted checkpoint keeps unchanged beside the
Megatron weights and an export writes back: ``checkpointing/hf_assets.py``); ``hf_to_mcore`` leaves
out both. A tied output layer is the embedding.
"""

import re
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Literal, Optional

import torch

FIELDS = ("layer", "expert")


def stack_rows(tensors: list[torch.Tensor], hf: dict) -> torch.Tensor:
    """The default ``join``: the HF tensors' rows one after another (a fused linear layer)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def equal_rows(parts: int) -> Callable[[torch.Tensor, dict], list[torch.Tensor]]:
    """The default ``split``: ``parts`` blocks of equal rows."""
    def split(tensor: torch.Tensor, hf: dict) -> list[torch.Tensor]:
        return [tensor] if parts == 1 else list(torch.chunk(tensor, parts, dim=0))
    return split


def rows_of(sizes: Callable[[dict], list[int]]) -> Callable[[torch.Tensor, dict], list[torch.Tensor]]:
    """A ``split`` into row blocks of the sizes ``sizes(hf)`` gives."""
    return lambda tensor, hf: list(torch.split(tensor, sizes(hf), dim=0))


def always(hf: dict, fields: dict) -> bool:
    """A rule that applies to every layer."""
    return True


@dataclass(frozen=True)
class WeightRule:
    """One Megatron tensor and the HF tensors it is made of."""

    mcore: str
    """Megatron name pattern, e.g. ``decoder.layers.{layer}.mlp.linear_fc1.weight``."""
    hf: tuple[str, ...]
    """HF name patterns with the same fields, in ``join`` order (several: a fused tensor)."""
    join: Callable[[list[torch.Tensor], dict], torch.Tensor] = stack_rows
    """``(HF tensors, hf config) -> Megatron tensor``."""
    split: Optional[Callable[[torch.Tensor, dict], list[torch.Tensor]]] = None
    """``(Megatron tensor, hf config) -> HF tensors`` (default: equal row blocks)."""
    applies: Callable[[dict, dict], bool] = always
    """``(hf config, fields) -> bool``: the layers the rule serves (e.g. full-attention ones)."""
    layout: Literal["both", "checkpoint", "module", "read"] = "both"
    """Which HF layout writes the rule (``mcore_to_hf``): checkpoint files, transformers'
    modules, both, or none (``read``: a layout some checkpoints hold that no export writes);
    ``hf_to_mcore`` reads every layout."""
    hf_stacked: bool = False
    """The (single) HF tensor stacks every expert of the layer along dim 0."""
    required: bool = False
    """Every layer the rule applies to must have it (checked unless ``partial``)."""

    def __post_init__(self):
        assert not self.hf_stacked or (len(self.hf) == 1 and "{expert}" in self.mcore
                                       and "{expert}" not in self.hf[0]), self

    def splitter(self) -> Callable[[torch.Tensor, dict], list[torch.Tensor]]:
        return self.split or equal_rows(len(self.hf))


def _compile(pattern: str) -> re.Pattern:
    regex = re.escape(pattern)
    for name in FIELDS:
        regex = regex.replace(re.escape("{" + name + "}"), f"(?P<{name}>\\d+)")
    return re.compile(regex)


def _fields(match: re.Match) -> dict:
    return {k: int(v) for k, v in match.groupdict().items()}


@dataclass(frozen=True)
class WeightMap:
    """A family's weight table and what the conversions need besides it (module doc)."""

    rules: tuple[WeightRule, ...]
    hf_prefixes: tuple[tuple[str, str], ...] = ()
    """``(prefix, canonical prefix)``: HF names written under another prefix (a multimodal
    checkpoint's text model) are read as the canonical ones, the names the rules use."""
    dropped: Callable[[str, dict], bool] = lambda name, hf: False
    """``(canonical HF name, hf config) -> bool``: HF tensors outside the Megatron model."""
    kept: Callable[[str, dict], bool] = lambda name, hf: False
    """``(canonical HF name, hf config) -> bool``: HF tensors outside the Megatron model that a
    converted checkpoint keeps and an export writes back (multi-token prediction)."""
    kept_layer: Callable[[str, dict], Optional[int]] = lambda name, hf: None
    """The multi-token-prediction layer a kept tensor belongs to (``None``: none)."""
    kept_layers_field: Optional[str] = None
    """The config field that counts those layers (``check_kept``)."""
    drop_warning: Optional[str] = None
    """Warn when ``hf_to_mcore`` (not ``partial``) drops tensors: ``{count}`` and the hf config's
    fields may be named in it."""
    tied_output: tuple[str, str] = ("lm_head.weight", "model.embed_tokens.weight")
    """``(HF output layer, HF embedding)``: under ``tie_word_embeddings`` the output layer is not
    a tensor of its own (read: ignored; written: the embedding, in transformers' module layout)."""
    num_layers_field: str = "num_hidden_layers"
    num_experts_field: str = "n_routed_experts"
    """The config field that counts a MoE layer's routed experts (stacked tensors hold them all)."""
    normalize: Callable[[dict], dict] = lambda hf: hf
    """The family's ``normalize_hf_config``: each conversion reads the config as given (e.g. a
    multimodal checkpoint's, its text model nested) through it."""

    @cached_property
    def _hf_patterns(self) -> list[tuple[re.Pattern, WeightRule, int]]:
        return [(_compile(p), rule, i) for rule in self.rules for i, p in enumerate(rule.hf)]

    @cached_property
    def _mcore_patterns(self) -> list[tuple[re.Pattern, WeightRule]]:
        return [(_compile(rule.mcore), rule) for rule in self.rules]

    # ---- HF names -------------------------------------------------------------------------------

    def canonical(self, name: str) -> str:
        """``name`` under the canonical prefix the rules use."""
        for prefix, canonical in self.hf_prefixes:
            if name.startswith(prefix):
                return canonical + name[len(prefix):]
        return name

    def _tied(self, name: str, hf: dict) -> bool:
        return name == self.tied_output[0] and bool(hf.get("tie_word_embeddings", False))

    def _match_hf(self, name: str, hf: dict) -> Optional[tuple[WeightRule, int, dict]]:
        """``(rule, position, fields)`` of a canonical HF name; ``ValueError`` for a layer past the
        model's or a rule that does not serve that layer; ``None`` when no rule names it."""
        for pattern, rule, position in self._hf_patterns:
            match = pattern.fullmatch(name)
            if match is None:
                continue
            fields = _fields(match)
            if "layer" in fields and fields["layer"] >= hf[self.num_layers_field]:
                raise ValueError(f"unexpected HF weight {name!r} (the config has {hf[self.num_layers_field]} "
                                 "layers)")
            if rule.applies(hf, fields):
                return rule, position, fields
        return None

    def hf_group(self, name: str, hf: dict) -> Optional[str]:
        """The group of an HF checkpoint tensor: tensors of one group convert together (the
        Megatron tensor they make; a stacked tensor is its own group); ``None`` for tensors
        outside the Megatron model, which ``hf_to_mcore`` drops. Used to stream a checkpoint a
        group at a time."""
        hf = self.normalize(hf)
        canonical = self.canonical(name)
        if self.dropped(canonical, hf) or self.kept(canonical, hf):
            return None
        try:
            found = self._match_hf(canonical, hf)
        except ValueError:
            found = None
        if found is None or found[0].hf_stacked:
            return name  # (an unknown tensor is refused by hf_to_mcore)
        rule, _, fields = found
        return rule.mcore.format(**fields)

    # ---- conversions ----------------------------------------------------------------------------

    def hf_to_mcore(self, hf_state: dict[str, torch.Tensor], hf: dict, *, partial: bool = False
                    ) -> dict[str, torch.Tensor]:
        """HF tensors -> full Megatron tensors. ``partial=True`` converts any union of whole
        ``hf_group`` groups (streaming) and skips the whole-model checks (``required`` rules) and
        the drop warning. ``ValueError`` names an unexpected HF tensor or the missing part of a
        fused one."""
        hf = self.normalize(hf)
        pending: dict[tuple[int, tuple], dict[int, tuple[str, torch.Tensor]]] = {}
        rules: dict[int, WeightRule] = {}
        dropped = []
        out: dict[str, torch.Tensor] = {}
        for name, tensor in hf_state.items():
            canonical = self.canonical(name)
            if self._tied(canonical, hf):
                continue
            if self.dropped(canonical, hf) or self.kept(canonical, hf):
                dropped.append(name)
                continue
            found = self._match_hf(canonical, hf)
            if found is None:
                raise ValueError(f"unexpected HF weight {name!r}")
            rule, position, fields = found
            if rule.hf_stacked:
                for expert in range(tensor.shape[0]):
                    out[rule.mcore.format(expert=expert, **fields)] = tensor[expert]
                continue
            key = (id(rule), tuple(sorted(fields.items())))
            rules[id(rule)] = rule
            pending.setdefault(key, {})[position] = (canonical, tensor)
        for (rule_id, fields), parts in pending.items():
            rule, fields = rules[rule_id], dict(fields)
            if len(parts) < len(rule.hf):
                have = parts[min(parts)][0]
                missing = rule.hf[min(set(range(len(rule.hf))) - set(parts))].format(**fields)
                raise ValueError(f"HF weights lack {missing!r} (needed with {have!r})")
            out[rule.mcore.format(**fields)] = rule.join([parts[i][1] for i in range(len(rule.hf))], hf)
        if not partial:
            self._check_required(hf_state, hf)
            if dropped and self.drop_warning:
                warnings.warn(self.drop_warning.format(count=len(dropped), **hf))
        return out

    def keeps(self, name: str, hf: dict) -> bool:
        """HF tensor ``name`` is one a converted checkpoint keeps for the export (``kept``)."""
        return self.kept(self.canonical(name), self.normalize(hf))

    def check_kept(self, names: list[str], hf: dict) -> None:
        """``ValueError`` when the kept tensors' multi-token-prediction layers are not as many as
        the config's ``kept_layers_field`` says (none kept: nothing to check)."""
        if not names or self.kept_layers_field is None:
            return
        hf = self.normalize(hf)
        layers = sorted({self.kept_layer(self.canonical(n), hf) for n in names} - {None})
        wanted = hf.get(self.kept_layers_field)
        if wanted is None or len(layers) != wanted:
            raise ValueError(f"the weights hold {len(layers)} multi-token-prediction layer(s) (e.g. {sorted(names)[0]!r}), "
                             f"the config's {self.kept_layers_field} is {wanted}")

    def _check_required(self, hf_state: dict, hf: dict) -> None:
        """``ValueError`` naming the first HF tensor a ``required`` rule lacks."""
        names = {self.canonical(n) for n in hf_state}
        for rule in self.rules:
            if not rule.required:
                continue
            for layer in range(hf[self.num_layers_field]):
                fields = {"layer": layer}
                if rule.applies(hf, fields) and rule.hf[0].format(**fields) not in names:
                    raise ValueError(f"HF weights lack {rule.hf[0].format(**fields)!r}")

    def mcore_to_hf(self, mcore_state: dict[str, torch.Tensor], hf: dict, *,
                    checkpoint_layout: bool = False) -> dict[str, torch.Tensor]:
        """Full Megatron tensors -> HF tensors (inverse of ``hf_to_mcore``), any subset of them.

        ``checkpoint_layout=True`` gives the names HF checkpoint files hold (one tensor per
        expert, no tied output layer); otherwise transformers' module layout (stacked experts,
        every expert of a layer given; the tied output layer as the embedding)."""
        hf = self.normalize(hf)
        wanted = "checkpoint" if checkpoint_layout else "module"
        stacked: dict[tuple[int, tuple], dict[int, torch.Tensor]] = {}
        rules: dict[int, WeightRule] = {}
        out: dict[str, torch.Tensor] = {}
        for name, tensor in mcore_state.items():
            rule, fields = self._match_mcore(name, hf, wanted)
            if rule.hf_stacked:
                expert = fields.pop("expert")
                key = (id(rule), tuple(sorted(fields.items())))
                rules[id(rule)] = rule
                stacked.setdefault(key, {})[expert] = tensor
                continue
            for pattern, part in zip(rule.hf, rule.splitter()(tensor, hf)):
                out[pattern.format(**fields)] = part
        for (rule_id, fields), by_expert in stacked.items():
            rule, fields = rules[rule_id], dict(fields)
            experts = hf[self.num_experts_field]
            if sorted(by_expert) != list(range(experts)):
                prefix = rule.mcore.split("{expert}")[0].format(**fields)
                raise ValueError(f"{prefix}: expected experts 0..{experts - 1}, got {sorted(by_expert)[:8]}")
            out[rule.hf[0].format(**fields)] = torch.stack([by_expert[e] for e in range(experts)])
        output, embedding = self.tied_output
        if hf.get("tie_word_embeddings", False) and not checkpoint_layout and embedding in out:
            out.setdefault(output, out[embedding])
        return {k: v.contiguous() for k, v in out.items()}

    def export_groups(self, names: list[str], hf: dict, *, checkpoint_layout: bool = True) -> list[list[str]]:
        """``names`` (Megatron weights) in the groups ``mcore_to_hf`` converts together: every
        expert of a layer for a rule whose HF tensor stacks them, each other weight alone; in
        the order of ``names``' first members."""
        hf = self.normalize(hf)
        wanted = "checkpoint" if checkpoint_layout else "module"
        groups: dict[object, list[str]] = {}
        for name in names:
            rule, fields = self._match_mcore(name, hf, wanted)
            if rule.hf_stacked:
                fields.pop("expert")
                key = (id(rule), tuple(sorted(fields.items())))
            else:
                key = name
            groups.setdefault(key, []).append(name)
        return list(groups.values())

    def _match_mcore(self, name: str, hf: dict, wanted: str) -> tuple[WeightRule, dict]:
        """The rule that writes Megatron tensor ``name`` in the layout ``wanted`` and its fields;
        ``ValueError`` when none does."""
        for pattern, rule in self._mcore_patterns:
            match = pattern.fullmatch(name)
            if match is None or rule.layout not in ("both", wanted):
                continue
            fields = _fields(match)
            if rule.applies(hf, fields):
                return rule, fields
        raise ValueError(f"unexpected Megatron weight {name!r}")


def layer_rules(renames: tuple[tuple[str, str], ...], hf_prefix: str = "model.layers.{layer}.",
                mcore_prefix: str = "decoder.layers.{layer}.", **kwargs) -> tuple[WeightRule, ...]:
    """One-to-one rules of a decoder layer's tensors: ``(HF suffix, Megatron suffix)`` pairs."""
    return tuple(WeightRule(mcore_prefix + mcore, (hf_prefix + hf_name,), **kwargs) for hf_name, mcore in renames)


def gate_up_rule(hf_prefix: str, mcore: str, **kwargs) -> WeightRule:
    """HF ``gate_proj`` and ``up_proj`` under ``hf_prefix`` fused into Megatron's ``[gate; up]``
    ``linear_fc1`` (a SwiGLU MLP or expert)."""
    return WeightRule(mcore, (hf_prefix + "gate_proj.weight", hf_prefix + "up_proj.weight"), **kwargs)


def untied(hf: dict, fields: dict) -> bool:
    """The output layer is a tensor of its own (no ``tie_word_embeddings``)."""
    return not hf.get("tie_word_embeddings", False)


MODEL_RULES = (WeightRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
               WeightRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
               WeightRule("output_layer.weight", ("lm_head.weight",), applies=untied))
"""The embedding, the final norm and the output layer: the same in every family of HF's decoder
layout."""
