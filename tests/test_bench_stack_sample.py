"""bench/lib/stack_sample.py: a thread's wall time by sampled stacks. The work below splits its time 3 : 1 between two
functions by construction (busy loops on the clock), so the sampled shares must split the same way; a recursive
function is counted once a sample."""
import threading
import time

from bench.lib.stack_sample import StackSampler


def _spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _three_parts():
    _spin(0.015)


def _one_part():
    _spin(0.005)


def _nested(depth):
    return _nested(depth - 1) if depth else (_three_parts(), _one_part())


def test_shares_follow_the_time_split_and_recursion_counts_once():
    with StackSampler(threading.get_ident(), interval_s=0.001) as s:
        for _ in range(20):
            _nested(5)
    t = s.table(per=20, top=50)
    assert s.samples >= 100 and 0.35 < t["wall_s"] < 2.0
    cum = {w.split("(")[-1].rstrip(")"): ms for w, ms in t["cum"]}
    own = {w.split("(")[-1].rstrip(")"): ms for w, ms in t["own"]}
    per_round_ms = t["wall_s"] * 1e3 / 20
    # every sample lies inside _nested, and a recursion 6 deep is one function on the stack, not 6
    assert abs(cum["_nested"] - per_round_ms) < 0.05 * per_round_ms
    share = cum["_three_parts"] / (cum["_three_parts"] + cum["_one_part"])
    assert 0.6 < share < 0.9, share  # 0.75 by construction
    assert own["_spin"] > 0.9 * (cum["_three_parts"] + cum["_one_part"])  # the innermost frame is the busy loop


def test_set_apart_keeps_one_functions_samples_out_of_the_tables():
    with StackSampler(threading.get_ident(), interval_s=0.001, set_apart="_three_parts") as s:
        for _ in range(20):
            _nested(5)
    t = s.table(per=20, top=50)
    cum = {w.split("(")[-1].rstrip(")"): ms for w, ms in t["cum"]}
    assert "_three_parts" not in cum and "_one_part" in cum
    share = t["apart_ms"] / (t["apart_ms"] + t["rest_ms"])
    assert 0.6 < share < 0.9, share  # 0.75 of the time is inside _three_parts, by construction
    assert abs(cum["_nested"] - t["rest_ms"]) < 0.05 * t["rest_ms"]  # the tables hold only the rest
