"""A model's language model as named tensors under causal-LM names, read one tensor at a time.

`CheckpointTensors` reads a checkpoint on disk (VLM or causal LM) without building the model: a
weightless (meta-device) instance of the checkpoint's own class gives the runtime parameter names and
shapes, transformers' conversion mapping (`get_model_conversion_mapping`, what `from_pretrained` applies)
renames the on-disk keys to them (and splits or joins fused tensors, e.g. Molmo2's `att_proj`), and
`get_decoder()` / `get_output_embeddings()` say which parameters form the language model. Only those are
ever read: the vision tower and projector are skipped by name. `ModelTensors` gives the same view of a
loaded model. Both expose `names`, `shape(name)`, `dtype(name)`, `get(name, rows=None)` and `tied`.
"""

from __future__ import annotations

import copy
import functools

from interventions.pairs import archs
from interventions.pairs.layout import PairMismatchError
from interventions.pairs.resolve import ModelSource
from sinkstudy.checkpoint import TensorReader

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def tensors_of(source: ModelSource, target_type: str | None = None):
    """The language-model tensors of a resolved source, named as the causal class `target_type` (default: its own)."""
    text_config = archs.text_config_of(source.config)
    target_type = target_type or archs.causal_types_for(text_config)[0]
    if source.model is not None:
        return ModelTensors(source.model, text_config, target_type)
    if source.weights is None:
        raise PairMismatchError(f"{source.id}: reading tensors one by one needs safetensors weights "
                                "(this checkpoint has only pytorch_model.bin)")
    return CheckpointTensors(source, text_config, target_type)


class _Renamer:
    """Runtime names of the source model -> causal-LM names (None outside the language model)."""

    def __init__(self, model, text_config, target_type: str):
        modules = {id(m): n for n, m in model.named_modules()}
        self.decoder = modules[id(model.get_decoder())] + "."
        self.head = modules[id(model.get_output_embeddings())] + ".weight"
        self.text_config, self.target_type = text_config, target_type

    def __call__(self, runtime: str) -> str | None:
        if runtime == self.head:
            return HEAD
        if runtime.startswith(self.decoder):
            return "model." + archs.rename_text_keys(self.text_config, self.target_type, runtime[len(self.decoder):])
        return None


class ModelTensors:
    """The language model of a loaded model (VLM or causal LM); `get` returns its own tensors."""

    def __init__(self, model, text_config, target_type: str):
        rename = _Renamer(model, text_config, target_type)
        prefix = rename.decoder.rstrip(".")
        decoder_state = model.get_decoder().state_dict()
        self._state = {rename(f"{prefix}.{k}"): v.detach() for k, v in decoder_state.items()}
        head = model.get_output_embeddings().weight.detach()
        self.tied = head.untyped_storage().data_ptr() == self._state[EMBED].untyped_storage().data_ptr()
        self._state[HEAD] = head
        self.names = list(self._state)

    def shape(self, name: str) -> tuple:
        return tuple(self._state[name].shape)

    def dtype(self, name: str):
        return self._state[name].dtype

    def get(self, name: str, rows: int | None = None):
        t = self._state[name]
        return t if rows is None else t[:rows]


class CheckpointTensors:
    """The language model inside a checkpoint on disk, read tensor by tensor (see the module docstring)."""

    def __init__(self, source: ModelSource, text_config, target_type: str):
        # lazy: loads torch, transformers, numpy
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        auto = AutoModelForImageTextToText if source.kind == "vlm" else AutoModelForCausalLM
        with torch.device("meta"):
            self._meta = auto.from_config(source.config)
        self.source = source
        self._reader = TensorReader(source.weights)
        rename = _Renamer(self._meta, text_config, target_type)
        meta_state = self._meta.state_dict()
        transforms = get_model_conversion_mapping(self._meta)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = self._meta.base_model_prefix

        # As from_pretrained: rename every on-disk key, group the sources of each converted parameter.
        self._groups: dict[str, tuple] = {}  # first runtime target -> (converter or None, [(disk key, pattern)])
        self._runtime: dict[str, tuple[str, str]] = {}  # causal name -> (runtime name, group)
        headers = source.weights.tensors
        for key in sorted(headers, key=dot_natural_key):
            runtime, pattern = rename_source_key(key, renamings, converters, prefix, meta_state)
            if runtime not in meta_state and key in meta_state:
                runtime, pattern = rename_source_key(key, [], [], prefix, meta_state)
            if runtime not in meta_state:
                raise PairMismatchError(f"{source.path}: tensor {key} matches no parameter of {type(self._meta).__name__}")
            if rename(runtime) is None:
                continue  # vision tower, projector: never read
            converter, sources = self._groups.setdefault(runtime, (by_pattern.get(pattern), []))
            sources.append((key, pattern))
            if converter is None and tuple(headers[key].shape) != tuple(meta_state[runtime].shape):
                raise PairMismatchError(f"{source.path}: {key} has shape {list(headers[key].shape)}, "
                                        f"the config needs {list(meta_state[runtime].shape)}")
        for first, (converter, _) in self._groups.items():
            targets = [first.replace(converter.target_patterns[0], t) for t in converter.target_patterns] if converter else [first]
            for runtime in targets:
                self._runtime[rename(runtime)] = (runtime, first)
        self._shapes = {rename(k): tuple(v.shape) for k, v in meta_state.items() if rename(k) is not None}
        self._dtypes = {name: headers[self._groups[g][1][0][0]].torch_dtype for name, (_, g) in self._runtime.items()}
        self._cache: tuple[str, dict] | None = None  # the last converted group (q, k, v come together)
        self.tied = False  # decided below; get() reads the stored lm_head until then
        # Tying as from_pretrained decides it: a config that ties shares the embedding, unless the checkpoint
        # stores a different lm_head; a config that does not tie needs its own lm_head.
        config_ties = bool(getattr(self._meta.config, "tie_word_embeddings", False))
        if HEAD not in self._runtime and not config_ties:
            raise PairMismatchError(f"{source.path}: no {rename.head} (output layer) and the config does not tie it")
        self.tied = HEAD not in self._runtime or (config_ties and torch.equal(self.get(EMBED), self.get(HEAD)))
        missing = [n for n in self._shapes if n not in self._runtime and not (n == HEAD and self.tied)]
        if missing:
            raise PairMismatchError(f"{source.path}: no tensor for {missing[0]} of the language model")
        self.names = list(self._runtime) + ([HEAD] if HEAD not in self._runtime else [])

    def shape(self, name: str) -> tuple:
        return self._shapes[name]

    def dtype(self, name: str):
        return self._dtypes[EMBED if name == HEAD and self.tied else name]

    def get(self, name: str, rows: int | None = None):
        if name == HEAD and self.tied:
            name = EMBED
        runtime, first = self._runtime[name]
        converter, sources = self._groups[first]
        if converter is None:
            return self._reader.get(sources[0][0], rows)
        if self._cache is None or self._cache[0] != first:
            self._cache = (first, self._convert(first, converter, sources))
        t = self._cache[1][runtime]
        return t if rows is None else t[:rows]

    def _convert(self, first: str, converter, sources) -> dict:
        conv = copy.deepcopy(converter)  # collects its inputs as from_pretrained's per-parameter copy does
        for key, pattern in sources:
            conv.add_tensor(first, key, pattern, functools.partial(self._reader.get, key))
        out = conv.convert(first, model=self._meta, config=self._meta.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}
