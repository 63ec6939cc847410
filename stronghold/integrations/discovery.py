"""Find a model's transformer block list and split its parameters into blocks and the rest.

Blocks are streamed; the rest (embeddings, final norm, head, and any other parameter) stays on the
GPU. Known HF architectures are found by attribute path; other models by the largest homogeneous
`nn.ModuleList`, or explicitly with `blocks=` / the `blocks_path` config key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from torch import nn

# Attribute paths of the block list in the HF architectures we name, most specific first.
KNOWN_BLOCK_PATHS = (
    "transformer.h",          # GPT-2, GPT-J, Bloom-style
    "model.layers",           # Llama, Qwen2, Mistral, Gemma, Phi-3
    "gpt_neox.layers",        # GPT-NeoX, Pythia
    "model.decoder.layers",   # OPT
    "transformer.layers",
    "decoder.layers",
    "layers",
    "h",
)


@dataclass
class ModelParts:
    """The block list of a model and the names of every parameter, split into blocks and rest."""

    blocks: list[nn.Module]
    path: str
    """Where the blocks were found ("<explicit>" when given by the caller)."""
    block_param_names: list[list[str]]
    """Per block, the names (relative to the model) of its parameters."""
    rest_param_names: list[str]


def _get_path(model: nn.Module, path: str) -> Optional[nn.Module]:
    obj = model
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, nn.Module) else None


def _is_block_list(obj: Optional[nn.Module]) -> bool:
    return isinstance(obj, (nn.ModuleList, nn.Sequential)) and len(obj) >= 1 and any(
        p is not None for p in obj.parameters())


def _largest_homogeneous_list(model: nn.Module) -> Optional[tuple[str, nn.Module]]:
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        numel = sum(p.numel() for p in module.parameters())
        if numel and (best is None or numel > best[0]):
            best = (numel, name, module)
    return None if best is None else (best[1], best[2])


def find_blocks(model: nn.Module, blocks: Optional[Sequence[nn.Module]] = None,
                blocks_path: Optional[str] = None) -> ModelParts:
    """Locate the block list; raise ValueError with the fix when there is none."""
    if blocks is not None:
        block_list, path = list(blocks), "<explicit>"
        if not block_list or not all(isinstance(b, nn.Module) for b in block_list):
            raise ValueError("blocks= must be a non-empty sequence of nn.Module (e.g. model.model.layers)")
    elif blocks_path is not None:
        found = _get_path(model, blocks_path)
        if not _is_block_list(found):
            raise ValueError(f"stronghold.blocks_path: {blocks_path!r} is not a ModuleList with parameters "
                             f"in {type(model).__name__}; give the dotted path of the transformer block list")
        block_list, path = list(found), blocks_path
    else:
        for candidate in KNOWN_BLOCK_PATHS:
            found = _get_path(model, candidate)
            if _is_block_list(found):
                block_list, path = list(found), candidate
                break
        else:
            guess = _largest_homogeneous_list(model)
            if guess is None:
                raise ValueError(
                    f"could not find the transformer block list of {type(model).__name__}: no known path "
                    f"({', '.join(KNOWN_BLOCK_PATHS)}) and no nn.ModuleList of >= 2 identical modules with "
                    "parameters. Pass blocks=<the list of blocks> to stronghold.initialize, or set "
                    "\"blocks_path\" in the stronghold section")
            path, found = guess
            block_list = list(found)
    return _split_parameters(model, block_list, path)


def _split_parameters(model: nn.Module, block_list: list[nn.Module], path: str) -> ModelParts:
    module_name = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    prefixes = []
    for index, block in enumerate(block_list):
        if id(block) not in module_name:
            raise ValueError(f"block {index} of {path} is not a submodule of {type(model).__name__}; pass blocks "
                             "that belong to the model being trained")
        prefixes.append(module_name[id(block)] + ".")
    owner = {}
    for index, block in enumerate(block_list):
        for param in block.parameters():
            if id(param) in owner and owner[id(param)] != index:
                raise ValueError(
                    f"a parameter is shared by blocks {owner[id(param)]} and {index} of {path}; stronghold streams "
                    "each block's parameters on its own, so weights shared across blocks are not supported")
            owner[id(param)] = index
    block_names: list[list[str]] = [[] for _ in block_list]
    rest, seen = [], set()
    for name, param in model.named_parameters(remove_duplicate=False):
        index = owner.get(id(param))
        if index is not None and not name.startswith(prefixes[index]):
            raise ValueError(f"parameter {name} is tied to a parameter of block {index} ({prefixes[index]}...); "
                             "stronghold cannot stream a block weight that is also used outside the block")
        if id(param) in seen:
            continue
        seen.add(id(param))
        (block_names[index] if index is not None else rest).append(name)
    for index, names in enumerate(block_names):
        if not names:
            raise ValueError(f"block {index} of {path} has no parameters; pass blocks= with only the "
                             "transformer blocks")
    return ModelParts(blocks=block_list, path=path, block_param_names=block_names, rest_param_names=rest)


REST_PARTS = ("input", "output")


def split_rest(model: nn.Module, parts: ModelParts) -> dict[str, list[str]]:
    """The parameters outside the blocks by side: "input" (owned by a module that comes before the first block in the
    model's module order, e.g. the input embeddings, or by the model itself) and "output" (the final norm, the LM
    head: after the blocks). A tied head is the embedding's parameter, owned first by the embedding: "input". The
    order of registration is the order of a transformer's forward in every model stronghold knows; a parameter on the
    wrong side only changes when its update runs, never its result (cached.py makes every part current before a
    forward). Parts without parameters are left out."""
    names = set(parts.rest_param_names)
    rest = {id(p): n for n, p in model.named_parameters() if n in names}
    in_blocks = {id(m) for block in parts.blocks for m in block.modules()}
    first_block = id(parts.blocks[0])
    side, found = "input", {name: [] for name in REST_PARTS}
    for module in model.modules():
        if id(module) == first_block:
            side = "output"
        if id(module) in in_blocks:
            continue
        for param in module.parameters(recurse=False):
            name = rest.pop(id(param), None)
            if name is not None:
                found[side].append(name)
    assert not rest, f"parameters outside every module: {sorted(rest.values())}"
    return {side: names for side, names in found.items() if names}


def tied_across(model: nn.Module, blocks: list[nn.Module]) -> bool:
    """Whether a parameter outside the blocks is registered on both sides of them (an LM head tied to the input
    embedding), in `split_rest`'s module order."""
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    side, seen = "input", {name: set() for name in REST_PARTS}
    for module in model.modules():
        if module is blocks[0]:
            side = "output"
        if id(module) not in in_blocks:
            seen[side].update(id(p) for p in module.parameters(recurse=False))
    return bool(seen["input"] & seen["output"])


def row_table(model: nn.Module, params: list[nn.Parameter], blocks: list[nn.Module]) -> Optional[nn.Embedding]:
    """The plain embedding table whose weight is the one parameter of `params` (a part's trainable ones), untied:
    its gradient is nonzero only in the rows of the batch's tokens (the blockwise walk sums those alone,
    engine/embedding_rows.py). None for anything else: several parameters, a tied head, an `nn.Embedding` whose
    gradient is not a plain sum of rows (`max_norm` renormalises the table, `scale_grad_by_freq` scales it) or
    that makes a sparse one."""
    if len(params) != 1 or tied_across(model, blocks):
        return None
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.weight is params[0]:
            plain = module.max_norm is None and not module.scale_grad_by_freq and not module.sparse
            return module if plain else None
    return None


def check_materialized(model: nn.Module) -> None:
    """Parameters on the meta device have no values to train from: say which and how to get them."""
    for name, param in model.named_parameters():
        if param.is_meta:
            raise ValueError(
                f"parameter {name!r} is on the meta device (no data): the model was built without weights "
                "(e.g. under torch.device('meta') or init_empty_weights). Materialise it first: load the "
                "weights (from_pretrained, or load_state_dict(..., assign=True)), or model.to_empty(device='cpu') "
                "followed by your initialisation, then call stronghold.initialize")
