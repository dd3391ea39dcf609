"""ppo_core/step/inputs.py: the checks of step()'s inputs, and their packing, by hand on small batches."""

from __future__ import annotations

import pytest
import torch

from ppo_core.step.inputs import build_model_inputs, build_response_masks, build_seq2seq_inputs, checked_step_inputs

CPU = torch.device("cpu")


def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens)


def test_causal_inputs_are_query_plus_response_right_padded():
    queries, responses = [ids(5, 6), ids(7)], [ids(8, 9, 10), ids(11)]
    inputs = build_model_inputs(queries, responses, pad_token_id=0)
    # row 0: 5 6 | 8 9 10; row 1: 7 | 11, then 3 fillers (1: the pad id is 0, and a pad id would make transformers
    # warn about a missing attention mask; causal attention never lets a real token see it)
    assert inputs.input_ids.tolist() == [[5, 6, 8, 9, 10], [7, 11, 1, 1, 1]]
    assert inputs.query_lens.tolist() == [2, 1] and inputs.response_lens.tolist() == [3, 1]
    assert tuple(inputs.sizes()) == (5, 3, 4, 0)  # longest sequence, longest response, response tokens, no encoder
    assert inputs.response_mask().tolist() == [[True, True, True], [True, False, False]]


def test_seq2seq_inputs_put_the_queries_in_the_encoder_and_start_plus_response_in_the_decoder():
    inputs = build_seq2seq_inputs([ids(5, 6), ids(7)], [ids(8, 9), ids(10)], decoder_start_token_id=2, pad_token_id=0)
    assert inputs.encoder_input_ids.tolist() == [[5, 6], [7, 0]]
    assert inputs.encoder_attention_mask.tolist() == [[1, 1], [1, 0]]
    assert inputs.input_ids.tolist() == [[2, 8, 9], [2, 10, 0]]
    assert inputs.query_lens.tolist() == [1, 1]  # the start token comes before each response
    assert tuple(inputs.sizes()) == (3, 2, 3, 2)


def test_rows_and_index_select_samples_with_their_host_lengths():
    inputs = build_model_inputs([ids(5, 6), ids(7), ids(3, 3, 3)], [ids(8), ids(9, 9), ids(4)], pad_token_id=0)
    picked = inputs.index(torch.tensor([2, 0]))
    assert picked.query_lens.tolist() == [3, 2] and picked.host_lens[:, 0].tolist() == [3, 2]
    assert picked.input_ids[0].tolist() == [3, 3, 3, 4]
    assert inputs.rows(1, 2).response_lens.tolist() == [2]


def test_a_user_response_mask_is_response_aligned_and_zero_past_each_response():
    inputs = build_model_inputs([ids(5), ids(6)], [ids(8, 9, 10), ids(11)], pad_token_id=0)
    masks = build_response_masks([ids(1, 0, 1), ids(1)], inputs)
    assert masks.tolist() == [[1, 0, 1], [1, 0, 0]]
    assert build_response_masks(None, inputs).tolist() == [[1, 1, 1], [1, 0, 0]]


def test_good_inputs_come_back_as_device_tensors_and_float_scores():
    q, r, s, m = checked_step_inputs(2, [ids(1, 2), ids(3)], [ids(4), ids(5, 6)], [1, torch.tensor(0.5)], None, CPU)
    assert s.dtype == torch.float32 and s.tolist() == [1.0, 0.5] and m is None
    assert [t.dtype for t in q + r] == [torch.long] * 4


@pytest.mark.parametrize("queries,responses,scores,masks,message", [
    ([ids(1)], [ids(2), ids(3)], [0.0, 0.0], None, r"batch size \(2\) does not match number of queries \(1\)"),
    ("q", [ids(2)], [0.0], None, r"queries must be a list of tensors, got str"),
    ([ids(1), torch.zeros(2, 2)], [ids(2), ids(3)], [0.0, 0.0], None, r"queries\[1\] must be a 1-D tensor"),
    ([ids(1), ids(1)], [ids(2), ids()], [0.0, 0.0], None, r"responses\[1\] is empty"),
    ([ids(1), ids(1)], [ids(2), ids(3)], [0.0, True], None, r"scores\[1\] must be a number"),
    ([ids(1), ids(1)], [ids(2), ids(3)], [0.0, torch.ones(2)], None, r"scores\[1\] must be a scalar"),
    ([ids(1), ids(1)], [ids(2), ids(3)], [float("nan"), 0.0], None, r"scores\[0\] is nan; scores must be finite"),
    ([ids(1), ids(1)], [ids(2), ids(3)], [0.0, 0.0], [ids(1)], r"response_masks has 1 entries, expected 2"),
    ([ids(1), ids(1)], [ids(2), ids(3)], [0.0, 0.0], [ids(1), ids(1, 1)], r"response_masks\[1\] has shape \(2,\)"),
])
def test_each_bad_input_is_one_line_naming_it(queries, responses, scores, masks, message):
    with pytest.raises(ValueError, match=message) as err:
        checked_step_inputs(2 if isinstance(queries, list) else 1, queries, responses, scores, masks, CPU)
    assert "\n" not in str(err.value)
