//! A chat row's tokens and which of them train: the conversation is rendered as the server
//! renders a request (`tokenize::tool_prompt`: with its functions, calls and results), so a
//! model tuned on it is served the prompt it learned; each trained assistant turn's span is found
//! by rendering the conversation's prefixes (templates need no `{% generation %}` markers), and
//! tokens are matched to spans by their byte offsets.

use anyhow::{bail, Context, Result};

use super::{TextTools, TrainOn, IGNORE_INDEX};
use crate::tokenize::tool_prompt;
use crate::train::formats::Chat;

/// Token labels for `ids` whose byte ranges `offsets` fall inside one of `spans`.
pub(super) fn mask_by_spans(ids: &[u32], offsets: &[(usize, usize)], spans: &[(usize, usize)]) -> Vec<i64> {
    ids.iter()
        .zip(offsets)
        .map(|(&id, &(a, b))| {
            let inside = spans.iter().any(|&(s, e)| a < e && b > s && b > a);
            if inside {
                id as i64
            } else {
                IGNORE_INDEX
            }
        })
        .collect()
}

/// One chat row: the rendered text's tokens and labels (`train_on` says which assistant turns
/// train; turns of `weight` 0 never do).
pub(super) fn chat_tokens(chat: &Chat, tools: &TextTools, train_on: TrainOn) -> Result<(Vec<u32>, Vec<i64>)> {
    let template = tools.template.context("chat rows need a chat template, and this model has none")?;
    let (messages, functions) = (&chat.messages, chat.tools.as_ref());
    let render =
        |upto: usize, add_generation_prompt: bool| tool_prompt::render_row(template, &messages[..upto], functions, add_generation_prompt);
    let full = render(messages.len(), false)?;
    let (ids, offsets) = (tools.encode)(&full, false)?;
    if train_on == TrainOn::All {
        let labels = ids.iter().map(|&x| x as i64).collect();
        return Ok((ids, labels));
    }
    let assistant: Vec<usize> = chat.trained_turns().collect();
    let chosen: Vec<usize> = match train_on {
        TrainOn::Completion => assistant.last().copied().into_iter().collect(),
        _ => assistant,
    };
    let mut spans = vec![];
    for i in chosen {
        let before = render(i, true)?;
        let through = render(i + 1, false)?;
        if !full.starts_with(&before) || !full.starts_with(&through) || through.len() < before.len() {
            bail!(
                "the chat template does not render the conversation's prefixes as prefixes of the whole, so the assistant \
                 tokens of message {i} cannot be located; use --train-on all"
            );
        }
        spans.push((before.len(), through.len()));
    }
    let labels = mask_by_spans(&ids, &offsets, &spans);
    Ok((ids, labels))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::{describe_sample, pad};
    use super::*;
    use crate::tokenize::ChatTemplate;
    use crate::train::formats::{parse_row, Example};

    /// A byte tokenizer: one token per byte, offsets exact.
    fn bytes(s: &str, _special: bool) -> Result<crate::tokenize::IdsWithOffsets> {
        Ok((s.bytes().map(|b| b as u32).collect(), (0..s.len()).map(|i| (i, i + 1)).collect()))
    }

    /// The row's text with the untrained parts in brackets (`describe_sample`'s marks, shortened).
    fn shown(template: &ChatTemplate, row: serde_json::Value, train_on: TrainOn) -> String {
        let Example::Chat(chat) = parse_row(&row, true).unwrap() else { panic!("a chat row") };
        let decode = |ids: &[u32]| -> Result<String> { Ok(ids.iter().map(|&i| i as u8 as char).collect()) };
        let tools = TextTools { encode: &bytes, decode: &decode, template: Some(template), eos_id: None, pad_id: 0 };
        let (ids, labels) = chat_tokens(&chat, &tools, train_on).unwrap();
        let len = ids.len();
        let described = describe_sample(&pad(ids, labels, len, 0), &decode).unwrap();
        described.replace("[masked]", "[").replace("[/masked]", "]")
    }

    fn weather_row() -> serde_json::Value {
        let call = json!([{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]);
        json!({"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": null, "tool_calls": call},
            {"role": "tool", "tool_call_id": "c1", "content": "18C"}, {"role": "assistant", "content": "18C."}],
            "tools": [{"type": "function", "function": {"name": "get_weather"}}]})
    }

    #[test]
    fn calls_train_and_results_do_not_in_the_generic_format() {
        let plain = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}</>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
            None,
            None,
        )
        .unwrap();
        let shown = shown(&plain, weather_row(), TrainOn::Auto);
        assert!(shown.starts_with("[<system>You may call functions."), "{shown}");
        assert!(
            shown.ends_with(
                "<user>weather?</><assistant>]<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}</tool_call></>[<user><tool_response>18C</tool_response></><assistant>]18C.</>"
            ),
            "{shown}"
        );
    }

    /// Qwen3's way with thinking, shortened: an assistant turn after the last user message
    /// writes its `reasoning_content` in a think block; earlier turns' thinking is dropped.
    const THINKING_TEMPLATE: &str = "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' and loop.index0 > ns.last_user and m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}</>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";

    #[test]
    fn a_turns_thinking_trains_where_the_template_writes_it_and_is_refused_where_it_would_be_dropped() {
        let thinking = ChatTemplate::new(THINKING_TEMPLATE, None, None).unwrap();
        let row =
            json!({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "add"}]});
        assert_eq!(shown(&thinking, row.clone(), TrainOn::Auto), "[<user>2+2?</><assistant>]<think>add</think>4</>");
        // Earlier turns' thinking is the template's to drop (and their answers still train).
        let mut two = row.clone();
        two["messages"]
            .as_array_mut()
            .unwrap()
            .extend([json!({"role": "user", "content": "3+3?"}), json!({"role": "assistant", "content": "6", "reasoning": "add"})]);
        assert_eq!(
            shown(&thinking, two, TrainOn::Completion),
            "[<user>2+2?</><assistant>4</><user>3+3?</><assistant>]<think>add</think>6</>"
        );
        let plain = ChatTemplate::new("{% for m in messages %}<{{ m.role }}>{{ m.content }}</>{% endfor %}", None, None).unwrap();
        let Example::Chat(chat) = parse_row(&row, true).unwrap() else { panic!("a chat row") };
        let decode = |ids: &[u32]| -> Result<String> { Ok(ids.iter().map(|&i| i as u8 as char).collect()) };
        let tools = TextTools { encode: &bytes, decode: &decode, template: Some(&plain), eos_id: None, pad_id: 0 };
        let e = format!("{:#}", chat_tokens(&chat, &tools, TrainOn::Auto).unwrap_err());
        assert!(e.contains("`reasoning_content` (or `reasoning`), but this model's chat template writes no thinking"), "{e}");
    }

    #[test]
    fn a_template_reading_tools_renders_them_and_a_weight_of_0_leaves_a_turn_untrained() {
        let native = ChatTemplate::new(
            "{% for t in tools %}({{ t.function.name }}){% endfor %}{% for m in messages %}<{{ m.role }}>{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | tojson }}{% else %}{{ m.content }}{% endif %}</>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
            None,
            None,
        )
        .unwrap();
        let row = weather_row();
        assert_eq!(
            shown(&native, row.clone(), TrainOn::Auto),
            "[(get_weather)<user>weather?</><assistant>]{\"city\": \"Oslo\"}</>[<tool>18C</><assistant>]18C.</>"
        );
        assert_eq!(
            shown(&native, row.clone(), TrainOn::Completion),
            "[(get_weather)<user>weather?</><assistant>{\"city\": \"Oslo\"}</><tool>18C</><assistant>]18C.</>"
        );
        let mut weighted = row;
        weighted["messages"][1]["weight"] = json!(0);
        assert_eq!(
            shown(&native, weighted, TrainOn::Auto),
            "[(get_weather)<user>weather?</><assistant>{\"city\": \"Oslo\"}</><tool>18C</><assistant>]18C.</>"
        );
    }
}
