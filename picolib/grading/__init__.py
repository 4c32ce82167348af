"""Checks for the exercises: `check_<name>(student_fn)` runs a student's function against
picolib's reference (on several ranks where the exercise is distributed), prints what
differs, and raises `ExerciseFailed` if anything does.

Each lesson keeps its checks in its own module (`lesson00.py`, `lesson01.py`, ...); the
list below is every check a notebook may call.
"""
from ._core import ExerciseFailed, call_student, compare, report, run_student
from .lesson00 import (check_all_gather_seconds, check_all_reduce_from_rs_ag,
                       check_bisection_bandwidth, check_node_bandwidth, check_ring_all_reduce,
                       check_ring_bytes, check_ring_time, check_sharp_switch, check_su_all_gather)
from .lesson01 import (check_activation_bytes, check_bytes_per_param, check_grad_accumulation,
                       check_param_count)
from .lesson02 import (check_accumulate_and_step, check_assign_buckets, check_average_gradients,
                       check_grad_accumulation_steps)
from .lesson03 import (check_gather_unit, check_reduce_scatter_gradients, check_shard_bounds,
                       check_zero1_step, check_zero_memory)
from .lesson04 import (check_conjugate_pair, check_kv_replicas, check_parallel_head, check_shards,
                       check_vocab_parallel_embedding, check_vocab_parallel_loss)
from .lesson05 import (check_gather_sequence, check_reduce_scatter_sequence,
                       check_sp_activation_bytes, check_sp_norm_weight_grad, check_tokens_per_day)
from .lesson06 import check_merge_partials, check_ring_pairs, check_zigzag_positions
from .lesson08 import check_dp_slicer, check_pipeline_latency, check_slice_mask
from .lesson10 import check_composition, check_mesh_coordinates, check_mesh_groups, check_state_bytes
from .lesson09 import (check_moe_critical_batch, check_sort_by_expert, check_split_sizes,
                       check_top_k_capacity)
from .lesson11 import (check_all_reduce_time, check_critical_tokens, check_fits,
                       check_sharded_all_reduce, check_spine_batch)
from .lesson07 import check_afab_stage, check_bubble, check_broken_schedules, check_one_f_one_b
from .lesson07b import check_backward_input, check_split_backward, check_zb_h1_ops
from .lesson12 import (check_attention_bytes, check_critical_rows, check_cuda_cores, check_fp8_quantize,
                       check_on_chip_bytes, check_roofline_time, check_vector_flops)

__all__ = [
    "ExerciseFailed", "call_student", "compare", "report", "run_student",
    "check_all_reduce_from_rs_ag", "check_ring_all_reduce", "check_ring_bytes", "check_ring_time",
    "check_node_bandwidth", "check_bisection_bandwidth", "check_sharp_switch",
    "check_all_gather_seconds", "check_su_all_gather",
    "check_activation_bytes", "check_bytes_per_param", "check_grad_accumulation",
    "check_param_count",
    "check_accumulate_and_step", "check_assign_buckets", "check_average_gradients",
    "check_grad_accumulation_steps",
    "check_gather_unit", "check_reduce_scatter_gradients", "check_shard_bounds",
    "check_zero1_step", "check_zero_memory",
    "check_conjugate_pair", "check_parallel_head", "check_shards", "check_vocab_parallel_loss",
    "check_vocab_parallel_embedding", "check_kv_replicas",
    "check_gather_sequence", "check_reduce_scatter_sequence", "check_sp_activation_bytes", "check_sp_norm_weight_grad",
    "check_tokens_per_day",
    "check_merge_partials", "check_ring_pairs", "check_zigzag_positions",
    "check_afab_stage", "check_bubble", "check_broken_schedules", "check_one_f_one_b",
    "check_backward_input", "check_split_backward", "check_zb_h1_ops",
    "check_dp_slicer", "check_pipeline_latency", "check_slice_mask",
    "check_all_reduce_time", "check_critical_tokens", "check_fits", "check_sharded_all_reduce",
    "check_spine_batch",
    "check_mesh_coordinates", "check_mesh_groups", "check_state_bytes", "check_composition",
    "check_moe_critical_batch", "check_sort_by_expert", "check_split_sizes", "check_top_k_capacity",
    "check_attention_bytes", "check_fp8_quantize", "check_roofline_time", "check_cuda_cores",
    "check_vector_flops", "check_critical_rows", "check_on_chip_bytes",
]
