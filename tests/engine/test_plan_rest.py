"""The planner's parts outside the blocks (plan_rest.py): bytes and step terms of the cached tier, the choice of tiers
by predicted step, the issue's Llama-3-8B shape under 24 and 16 GiB, the start-up table; the inputs from a live model
(the rest split by side, plan_inputs.model_spec) and the GPU budget with a process memory fraction."""
import pytest
import torch

from stronghold.config import parse_stronghold_section, resolve
from stronghold.integrations.discovery import find_blocks, split_rest
from stronghold.planning import initial_plan, plan_inputs, plan_text
from stronghold.planning.planner import (GIB, Activations, BlockSpec, Budgets, ModelSpec, PartSpec, Rates, Tier,
                                         plan)

from .helpers import tiny_gpt2, tiny_llama

N = 1_000_000
ACTS = Activations(fixed_peak_bytes=3_000_000, per_block_bytes=100_000)
RATES = Rates(h2d_bytes_per_s=1e9, d2h_bytes_per_s=2e9, cpu_adam_params_per_s=1e8, gpu_s_per_block=0.002,
              gpu_s_fixed=0.003)


def model(embed=2 * N, head=2 * N, n_blocks=4, compute_bytes=2, accumulation_steps=1):
    parts = (PartSpec(name="input", numel=embed, trainable_numel=embed, before_blocks=True),
             PartSpec(name="output", numel=head, trainable_numel=head, before_blocks=False))
    return ModelSpec(blocks=(BlockSpec(numel=N, trainable_numel=N),) * n_blocks, rest_numel=embed + head,
                     rest_trainable_numel=embed + head, compute_bytes=compute_bytes,
                     accumulation_steps=accumulation_steps, rest_parts=parts)


def budgets(gpu, host=10 ** 12):
    return Budgets(gpu_bytes=gpu, host_bytes=host, gpu_margin_bytes=0, host_margin_bytes=0)


def tiers(p):
    return dict(p.rest_tiers)


# Bytes and terms ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gas", [1, 4])
def test_a_cached_part_keeps_weights_and_gradients_on_the_gpu_and_its_states_on_the_host(gas):
    """bf16: a resident part costs 16 bytes a parameter on the GPU (+4 accumulating) and, without accumulation, an fp32
    chunk of gradients at the update (accumulating, the update reads the fp32 accumulators); cached, 4 (weight and gradient), and on the host 12 (master, moments) + 2 (working copy) + 2 per
    gradient buffer (two accumulating) + 4 (fp32 accumulator, accumulating), and 4 bytes a store (the gradients' sum of
    squares)."""
    m, roomy = model(accumulation_steps=gas), budgets(10 ** 15)
    resident = plan(m, ACTS, roomy, RATES, resident_blocks=4)
    cached = plan(m, ACTS, roomy, RATES, resident_blocks=4, rest_tiers={"output": Tier.CACHED})
    head, acc = 2 * N, gas > 1
    assert tiers(cached) == {"input": Tier.RESIDENT, "output": Tier.CACHED}
    assert resident.gpu.rest - cached.gpu.rest == head * (16 + 4 * acc) - head * 4
    # The resident update upcasts the largest chunk: the resident rest (both parts, then the input alone).
    assert resident.gpu.transients - cached.gpu.transients == head * 4 * (not acc)
    assert resident.host.total == 0
    h = cached.host
    assert (h.master_and_moments, h.working, h.grads, h.accumulators) == (12 * head, 2 * head,
                                                                         2 * head * (1 + acc) + 4, 4 * head * acc)


def test_cached_parts_add_their_copies_cpu_work_and_the_input_part_tail():
    """Per step: the cached parts' weights go up once, their gradients down every pass; the CPU updates them (and
    accumulates every pass); the input embeddings' D2H and update follow the last block's backward: a tail."""
    m = model(accumulation_steps=2)
    base = plan(m, ACTS, budgets(10 ** 15), RATES, resident_blocks=4)
    output = plan(m, ACTS, budgets(10 ** 15), RATES, resident_blocks=4, rest_tiers={"output": Tier.CACHED})
    both = plan(m, ACTS, budgets(10 ** 15), RATES, resident_blocks=4, rest_tiers=Tier.CACHED)
    head = 2 * N
    assert output.h2d_bytes_per_step == 2 * head and output.d2h_bytes_per_step == 2 * 2 * head
    assert output.floor.cpu_adam_s == pytest.approx(head * (1 + 2 * 10 / 28) / 1e8)
    assert output.floor.walk_s == pytest.approx(base.floor.walk_s + 2 * head / 1e9)
    assert output.floor.cpu_tail_s == base.floor.cpu_tail_s == 0.0
    assert both.floor.cpu_tail_s == pytest.approx(2 * N * 2 / 2e9 + 2 * N * (1 + 10 / 28) / 1e8)


# The choice --------------------------------------------------------------------------------------------------
def test_auto_keeps_the_rest_resident_where_it_fits_and_is_not_slower():
    p = plan(model(), ACTS, budgets(10 ** 12), RATES, rest_tiers=None)
    assert tiers(p) == {"input": Tier.RESIDENT, "output": Tier.RESIDENT} and p.resident_blocks == 4


def test_auto_moves_a_part_to_the_host_only_when_the_resident_plan_does_not_fit():
    m = model()
    all_resident = plan(m, ACTS, budgets(10 ** 15), RATES, resident_blocks=0, window_size=2)
    one_cached = plan(m, ACTS, budgets(10 ** 15), RATES, resident_blocks=0, window_size=2,
                      rest_tiers={"input": Tier.RESIDENT, "output": Tier.CACHED})
    assert one_cached.gpu.needed < all_resident.gpu.needed
    gpu = one_cached.gpu.needed
    with pytest.raises(MemoryError, match="rest of the model.*\"rest_placement\" to \"auto\" or \"host\""):
        plan(m, ACTS, budgets(gpu), RATES)  # the default keeps the rest resident
    p = plan(m, ACTS, budgets(gpu), RATES, rest_tiers=None)
    assert p.cached_parts and p.gpu.needed <= gpu
    # With both cached the GPU holds the fewest bytes; one part is enough here, so one stays resident.
    assert len(p.cached_parts) == 1


def test_auto_prefers_resident_blocks_to_a_resident_rest_when_they_make_the_faster_step():
    """A slow link makes every streamed block cost a lot; the rest's GPU bytes buy resident blocks instead."""
    m = model(embed=N, head=N, n_blocks=6)
    slow = Rates(h2d_bytes_per_s=1e8, d2h_bytes_per_s=1e8, cpu_adam_params_per_s=1e9, gpu_s_per_block=0.002,
                 gpu_s_fixed=0.003)
    resident_rest = plan(m, ACTS, budgets(10 ** 15), slow, resident_blocks=3, window_size=2)
    gpu = resident_rest.gpu.needed
    assert plan(m, ACTS, budgets(gpu), slow).resident_blocks == 3
    p = plan(m, ACTS, budgets(gpu), slow, rest_tiers=None)
    assert p.cached_parts and p.resident_blocks > 3
    assert p.predicted_step_s < resident_rest.predicted_step_s


def test_forced_tiers_and_their_errors():
    m = model()
    assert tiers(plan(m, ACTS, budgets(10 ** 12), RATES, rest_tiers=Tier.CACHED)) == {
        "input": Tier.CACHED, "output": Tier.CACHED}
    with pytest.raises(ValueError, match="unknown parts \\['head'\\]"):
        plan(m, ACTS, budgets(10 ** 12), RATES, rest_tiers={"head": Tier.CACHED})
    ranks = Budgets(gpu_bytes=10 ** 12, host_bytes=10 ** 12, local_ranks=2)
    assert tiers(plan(m, ACTS, ranks, RATES, rest_tiers=Tier.CACHED)) == {"input": Tier.CACHED, "output": Tier.CACHED}
    with pytest.raises(ValueError, match="not resident or cached"):
        plan(m, ACTS, budgets(10 ** 12), RATES, rest_tiers=Tier.STREAMED)
    # Where everything fits, "auto" keeps the rest resident, with data parallel too; so does a part with nothing to
    # train.
    assert not plan(m, ACTS, ranks, RATES, rest_tiers=None).cached_parts
    frozen = ModelSpec(blocks=m.blocks, rest_numel=m.rest_numel, rest_trainable_numel=2 * N, compute_bytes=2,
                       rest_parts=(PartSpec(name="input", numel=2 * N, trainable_numel=0),
                                   PartSpec(name="output", numel=2 * N, trainable_numel=2 * N, before_blocks=False)))
    tight = plan(frozen, ACTS, budgets(10 ** 15), RATES, resident_blocks=4, rest_tiers={"output": Tier.CACHED})
    assert tiers(plan(frozen, ACTS, budgets(tight.gpu.needed), RATES, rest_tiers=None))["input"] is Tier.RESIDENT


def test_the_table_lists_each_part_with_its_tier():
    text = plan_text.table(plan(model(), ACTS, budgets(10 ** 12), RATES, rest_tiers={"input": Tier.CACHED}))
    assert "input     cached" in text and "output    resident" in text


# The shape -------------------------------------------------------------------------------------------
def llama3_8b(accumulation_steps=8) -> ModelSpec:
    h, inter, layers, vocab, kv = 4096, 14336, 32, 128256, 1024
    block = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    embed = vocab * h
    parts = (PartSpec(name="input", numel=embed, trainable_numel=embed),
             PartSpec(name="output", numel=embed + h, trainable_numel=embed + h, before_blocks=False))
    return ModelSpec(blocks=(BlockSpec(numel=block, trainable_numel=block),) * layers, rest_numel=2 * embed + h,
                     rest_trainable_numel=2 * embed + h, compute_bytes=2, accumulation_steps=accumulation_steps,
                     rest_parts=parts)


@pytest.mark.parametrize("gpu_gib", [24, 16])
def test_llama3_8b_fits_24_and_16_gib_with_the_rest_cached(gpu_gib):
    """Llama-3-8B (vocabulary 128256, untied): the rest resident needs 19.6 GiB on the GPU, more than the card beside
    the window; cached, its weights and gradients take 3.9 GiB and the start-up plan fits both caps."""
    spec, budget = llama3_8b(), Budgets(gpu_bytes=gpu_gib * GIB, host_bytes=240 * GIB)
    on_gpu = resolve(parse_stronghold_section({"stronghold": {"rest_placement": "gpu"}}), torch.device("cuda"))
    with pytest.raises(MemoryError, match="rest of the model 19.57"):
        initial_plan.initial_plan(spec, budget, on_gpu)
    p = initial_plan.initial_plan(spec, budget, resolve(parse_stronghold_section({}), torch.device("cuda")))
    assert p.cached_parts == {"input", "output"}
    assert p.gpu.rest == 2 * 2 * spec.rest_numel and p.gpu.rest / GIB == pytest.approx(3.91, abs=0.01)
    assert p.gpu.needed <= budget.gpu_bytes


def test_llama3_8b_fits_two_24_gib_ranks_with_the_rest_cached():
    """Two ranks on a node: the rest's fp32 states go to the host as on one GPU (each rank its shard), where resident
    they would take 19.57 GiB of each GPU; the node's host bytes are the one-rank plan's, split over the ranks."""
    spec, settings = llama3_8b(), resolve(parse_stronghold_section({}), torch.device("cuda"))
    two = initial_plan.initial_plan(spec, Budgets(gpu_bytes=24 * GIB, host_bytes=240 * GIB, local_ranks=2), settings)
    assert two.cached_parts == {"input", "output"} and two.gpu.needed <= 24 * GIB
    on_gpu = resolve(parse_stronghold_section({"stronghold": {"rest_placement": "gpu"}}), torch.device("cuda"))
    with pytest.raises(MemoryError, match="rest of the model 19.57"):
        initial_plan.initial_plan(spec, Budgets(gpu_bytes=24 * GIB, host_bytes=240 * GIB, local_ranks=2), on_gpu)


def test_a_host_too_small_for_every_attempt_is_named_first():
    """On a 126 GiB host the 8B fits no attempt: with the rest cached the host is short, with it resident the GPU.
    The refusal leads with the attempt that offloads the most, whose shortfall is the one to act on."""
    spec, budget = llama3_8b(), Budgets(gpu_bytes=24 * GIB, host_bytes=126 * GIB)
    with pytest.raises(MemoryError) as refused:
        initial_plan.initial_plan(spec, budget, resolve(parse_stronghold_section({}), torch.device("cuda")))
    text = str(refused.value)
    assert text.startswith("stronghold's placement does not fit host memory") and "accumulators" in text
    assert text.index("with them on the GPU: stronghold's placement does not fit the GPU") > text.index("nvme_path")
    assert "rest of the model 19.57" in text


# Inputs from a live model ------------------------------------------------------------------------------------
def test_the_rest_splits_into_input_and_output_parts_tied_weights_once():
    llama = tiny_llama(2)
    assert split_rest(llama, find_blocks(llama)) == {"input": ["model.embed_tokens.weight"],
                                                     "output": ["model.norm.weight", "lm_head.weight"]}
    tied = tiny_llama(2, tie=True, qwen2=True)
    assert split_rest(tied, find_blocks(tied)) == {"input": ["model.embed_tokens.weight"],
                                                   "output": ["model.norm.weight"]}
    gpt2 = tiny_gpt2(2)
    gpt2.transformer.wpe.weight.requires_grad_(False)
    parts = find_blocks(gpt2)
    spec = plan_inputs.model_spec(gpt2, parts, {id(p) for p in gpt2.parameters() if p.requires_grad},
                                  torch.bfloat16, 1)
    wte, wpe, ln_f = (gpt2.transformer.wte.weight.numel(), gpt2.transformer.wpe.weight.numel(),
                      2 * gpt2.transformer.ln_f.weight.numel())
    assert spec.rest_parts == (PartSpec(name="input", numel=wte + wpe, trainable_numel=wte),
                               PartSpec(name="output", numel=ln_f, trainable_numel=ln_f, before_blocks=False))


def test_rest_placement_config_maps_to_planner_tiers():
    spec = model()

    def config(value, device="cuda"):
        return resolve(parse_stronghold_section({"stronghold": {"rest_placement": value}}), torch.device(device))

    assert plan_inputs.rest_tiers(config("auto"), spec) is None
    assert plan_inputs.rest_tiers(config("host"), spec) is Tier.CACHED
    assert plan_inputs.rest_tiers(config({"output": "gpu"}), spec) == {"input": None, "output": Tier.RESIDENT}
    assert plan_inputs.cached_on_cpu(config("auto", "cpu")) == frozenset()
    assert plan_inputs.cached_on_cpu(config({"input": "host"}, "cpu")) == {"input"}
    with pytest.raises(ValueError, match="stronghold.rest_placement: should be \"auto\", \"gpu\", \"host\" or a "
                                         "mapping"):
        config({"head": "host"})


# The GPU budget ----------------------------------------------------------------------------------------------
def _memory(free=70, reserved=2, total=80, allocated=0, fraction=1.0):
    return plan_inputs.DeviceMemory(free=free * GIB, total=total * GIB, reserved=reserved * GIB,
                                    allocated=allocated * GIB, fraction=fraction)


def test_the_gpu_budget_is_the_least_of_the_cap_the_memory_fraction_and_free_memory():
    assert plan_inputs.gpu_budget_bytes(_memory(), None) == 72 * GIB  # free + this process's reserve
    assert plan_inputs.gpu_budget_bytes(_memory(fraction=0.4), None) == 32 * GIB
    assert plan_inputs.gpu_budget_bytes(_memory(fraction=0.4), 24) == 24 * GIB
    assert plan_inputs.gpu_budget_bytes(_memory(fraction=0.2), 24) == 16 * GIB
    assert plan_inputs.gpu_budget_bytes(_memory(free=10, fraction=0.5), 24) == 12 * GIB


def test_budgets_of_a_process_capped_by_a_memory_fraction():
    """A process that set its memory fraction itself (a shared GPU, or a smaller card emulated) is planned within it,
    not within the free memory of the whole card; what it already holds beside the model comes off."""
    model = tiny_llama(2)
    settings = resolve(parse_stronghold_section({}), torch.device("cuda", 0))
    budget = plan_inputs.budgets(model, settings, torch.device("cuda", 0), memory=_memory(fraction=0.4, allocated=3))
    assert budget.gpu_bytes == 29 * GIB and budget.gpu_held_bytes == 3 * GIB


def test_a_gpu_refusal_names_what_the_process_already_held_beside_the_model():
    """An engine built before and not destroyed (a notebook cell run again) keeps its GPU memory, which the next
    engine's budget leaves out: the refusal says how much, and how to free it; a held amount the size of the CUDA
    context's own allocations is not named."""
    spec = model(n_blocks=4)
    held = Budgets(gpu_bytes=GIB // 1024, gpu_held_bytes=3 * GIB, host_bytes=10 ** 12, gpu_margin_bytes=0,
                   host_margin_bytes=0)
    with pytest.raises(MemoryError, match=r"GPU budget is 0\.00 GiB, after the 3\.00 GiB this process already holds "
                                          r"on the GPU outside the model .*engine\.destroy\(\)"):
        plan(spec, ACTS, held, RATES, rest_tiers=Tier.RESIDENT)
    small = Budgets(gpu_bytes=GIB // 1024, gpu_held_bytes=plan_text.HELD_NAMED_BYTES - 1, host_bytes=10 ** 12,
                    gpu_margin_bytes=0, host_margin_bytes=0)
    with pytest.raises(MemoryError) as refused:
        plan(spec, ACTS, small, RATES, rest_tiers=Tier.RESIDENT)
    assert "already holds" not in str(refused.value) and "does not fit the GPU" in str(refused.value)


def test_data_parallel_budgets_get_back_every_local_ranks_model(monkeypatch):
    """Each rank of a node built its own CPU model, and the node-shared copy replaces them all: the node's host budget
    is the memory available (read after every rank has built its model) plus all of the node's model copies, not
    only this rank's (a 2-rank run was refused a model one rank trained)."""
    model = tiny_llama(2)
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    order = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 3)

    def gather(out, mine):
        order.append("gather")
        out[:] = [mine, (mine[0], 2 * own), ("another-node", 5 * own)]
    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    monkeypatch.setattr(plan_inputs, "host_available", lambda limit: order.append("available") or 100 * GIB)
    settings = resolve(parse_stronghold_section({}), torch.device("cuda", 0))
    budget = plan_inputs.budgets(model, settings, torch.device("cuda", 0), memory=_memory())
    assert budget.host_bytes == 100 * GIB + 3 * own and budget.local_ranks == 3
    assert order == ["gather", "available"]
