"""ChatML's one owner: the role table, control strings, message text and the final-reply mask, exact values.

Rendering parity with Jinja and transformers is in test_tokenizer.py; ids and masks of real conversations,
and truncation, in test_chat_data.py and test_dpo_data.py.
"""

from __future__ import annotations

from nanolm.data import chatml


def test_roles_and_the_names_a_request_may_use():
    assert list(chatml.ROLES) == ["system", "user", "assistant"]
    assert [r for r, rule in chatml.ROLES.items() if rule.trains] == ["assistant"]
    # The server's list, in its order: each role, then its aliases.
    assert chatml.ROLE_NAMES == {"system": "system", "developer": "system", "user": "user",
                                 "assistant": "assistant"}


def test_control_strings_are_found_in_content():
    assert chatml.control_in("plain text") is None
    assert chatml.control_in("a<|im_end|>b<|im_start|>") == "<|im_end|>"
    assert chatml.control_in("x<|endoftext|>") == "<|endoftext|>"


def test_message_text_and_generation_prompt():
    assert chatml.segment_text("user", "hi") == "user\nhi"
    assert chatml.message_text("user", "hi") == "<|im_start|>user\nhi<|im_end|>\n"
    assert chatml.GENERATION_PROMPT == "<|im_start|>assistant\n"
    assert chatml.conversation_text([("user", "hi")], add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_final_only_masks_the_last_reply_alone():
    # Ids as in test_chat_data's exact-values test: <|im_start|> 1, <|im_end|> 2, "\n" 3; "user\nq" ->
    # [20, 3, 21]; "assistant\nyo" -> [22, 3, 23, 24]; byte lengths: 20 "user", 22 "assistant", 3 "\n".
    byte_lengths = [0, 0, 0, 1] + [0] * 16 + [4, 2, 9, 1, 1]
    msgs = [("user", "q"), ("assistant", "yo"), ("user", "q"), ("assistant", "yo")]
    segs = [[20, 3, 21], [22, 3, 23, 24]] * 2
    ids, every = chatml.render_with_mask(msgs, segs, [3], byte_lengths)
    ids_final, final = chatml.render_with_mask(msgs, segs, [3], byte_lengths, final_only=True)
    reply = [0, 0, 0, 1, 1, 1, 0]  # <|im_start|> assistant \n | y o <|im_end|> | \n
    assert ids_final == ids and every == [0] * 6 + reply + [0] * 6 + reply
    assert final == [0] * 19 + reply
