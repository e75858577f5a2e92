import pytest
import torch

from neox.data.batch import build_batch, document_ids, document_positions

EOD = 0


def test_inputs_and_labels_are_the_window_shifted_by_one():
    text = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 5]])
    batch = build_batch(text, EOD)
    assert batch.tokens.tolist() == [[5, 6, 7, 8], [1, 2, 3, 4]]
    assert batch.labels.tolist() == [[6, 7, 8, 9], [2, 3, 4, 5]]
    assert batch.tokens.dtype == batch.labels.dtype == torch.int64
    assert batch.loss_mask.dtype == torch.float32 and bool(batch.loss_mask.eq(1).all())
    assert batch.position_ids.tolist() == [[0, 1, 2, 3]] * 2
    assert batch.attention_mask is None and batch.document_ids is None


def test_eod_mask_loss_zeroes_positions_whose_input_is_eod():
    text = torch.tensor([[4, EOD, 6, 7, EOD, 9]])
    assert build_batch(text, EOD).loss_mask.tolist() == [[1, 1, 1, 1, 1]]
    masked = build_batch(text, EOD, eod_mask_loss=True)
    assert masked.loss_mask.tolist() == [[1, 0, 1, 1, 0]]


def test_position_ids_restart_after_each_eod():
    tokens = torch.tensor([[3, EOD, 5, 6, EOD, EOD, 8], [EOD, 1, 2, 3, 4, 5, 6]])
    assert document_positions(tokens, EOD).tolist() == [
        [0, 1, 0, 1, 2, 0, 0],
        [0, 0, 1, 2, 3, 4, 5],
    ]
    text = torch.cat([tokens, torch.ones(2, 1, dtype=torch.long)], dim=1)
    batch = build_batch(text, EOD, reset_position_ids=True)
    assert batch.position_ids.tolist() == document_positions(tokens, EOD).tolist()


def test_reset_attention_mask_keeps_attention_causal_and_within_documents():
    tokens = torch.tensor([[3, EOD, 5, 6, EOD, 8]])
    assert document_ids(tokens, EOD).tolist() == [[0, 0, 1, 1, 1, 2]]
    text = torch.cat([tokens, torch.tensor([[9]])], dim=1)
    batch = build_batch(text, EOD, reset_attention_mask=True)
    mask = batch.attention_mask
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    docs = batch.document_ids[0]
    for i in range(6):
        for j in range(6):
            assert bool(mask[0, 0, i, j]) == (j <= i and bool(docs[i] == docs[j])), (i, j)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="seq_length"):
        build_batch(torch.tensor([1, 2, 3]), EOD)
    with pytest.raises(ValueError, match="seq_length"):
        build_batch(torch.tensor([[1]]), EOD)


def test_label_windows_mask_where_minus_100_and_target_their_own_values():
    text = torch.tensor([[5, 6, 7, 8, 9]])
    label = torch.tensor([[-100, -100, 7, 8, -100]])
    batch = build_batch(text, EOD, label=label)
    assert batch.labels.tolist() == [[0, 7, 8, 0]]  # masked targets hold a valid id, 0
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0]]
    assert batch.trained_tokens.item() == 2
    # EOD masking composes with the label mask; document resets read the tokens alone.
    text = torch.tensor([[5, EOD, 7, 8, 9]])
    label = torch.tensor([[5, EOD, 7, 8, 9]])
    both = build_batch(text, EOD, True, True, True, label=label)
    assert both.loss_mask.tolist() == [[1, 0, 1, 1]]
    assert both.position_ids.tolist() == [[0, 1, 0, 1]]
    assert both.attention_mask[0, 0].tolist()[2] == [False, False, True, False]
    with pytest.raises(ValueError, match="must match the text windows"):
        build_batch(text, EOD, label=label[:, :-1])
