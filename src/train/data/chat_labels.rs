//! A chat row's tokens and which of them train: the conversation is rendered as the server
//! renders a request (`tokenize::tool_prompt`: with its functions, calls and results), so a
//! model tuned on it is served the prompt it learned; each trained assistant turn's span is found
//! by rendering the conversation's prefixes, else (a template that writes a turn differently once
//! others follow it) where the whole changes with the turn, as Axolotl finds turns; templates need
//! no `{% generation %}` markers. Tokens are matched to spans by their byte offsets.

use anyhow::{bail, Context, Result};

use super::{TextTools, TrainOn, IGNORE_INDEX};
use crate::tokenize::{tool_prompt, ChatMessage};
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
    let mut closing = None;
    for i in chosen {
        let before = render(i, true)?;
        let through = render(i + 1, false)?;
        if full.starts_with(&before) && full.starts_with(&through) && through.len() >= before.len() {
            spans.push((before.len(), through.len()));
            continue;
        }
        // The template writes this turn differently when it ends the conversation (Qwen3's
        // empty think block on the last turn, its dropping of thinking before the last user
        // message): find the turn where the whole differs from the whole with the turn blanked.
        let closing = match &closing {
            Some(c) => c,
            None => closing.insert(turn_closing(&|m: &[ChatMessage]| tool_prompt::render_row(template, m, functions, false))?),
        };
        let blank = blanked(messages, i);
        let span = span_by_difference(&full, &tool_prompt::render_row(template, &blank, functions, false)?, closing)
            .filter(|_| full.starts_with(&before))
            .map(|(start, end)| (start.min(before.len()), end));
        match span {
            Some(span) => spans.push(span),
            None => bail!(
                "the chat template renders message {i} so that its assistant tokens cannot be located (neither as a prefix of \
                 the whole nor where the whole changes with it); use --train-on all or --train-on completion"
            ),
        }
    }
    let labels = mask_by_spans(&ids, &offsets, &spans);
    Ok((ids, labels))
}

/// Stands in for a turn's text where a turn is located by difference: private-use characters no
/// real text holds.
const MARKER: &str = "\u{e000}\u{e001}";

/// The conversation with turn `i`'s content replaced by [`MARKER`], its calls and thinking gone.
fn blanked(messages: &[ChatMessage], i: usize) -> Vec<ChatMessage> {
    let mut out = messages.to_vec();
    let turn = &mut out[i];
    (turn.content, turn.tool_calls, turn.reasoning) = (MARKER.to_string(), None, None);
    out
}

/// The bytes where `full` and `blank` (the same conversation with one turn blanked) differ, as
/// a span of `full`, stretched over the `closing` text the template writes after a turn (its end
/// token, which the turn trains on). None when they do not differ.
fn span_by_difference(full: &str, blank: &str, closing: &str) -> Option<(usize, usize)> {
    let mut prefix = common_len(full.bytes(), blank.bytes());
    let suffix = common_len(full.bytes().rev(), blank.bytes().rev()).min(full.len() - prefix).min(blank.len() - prefix);
    let mut end = full.len() - suffix;
    // Whole characters: two texts may differ inside one.
    while !full.is_char_boundary(prefix) {
        prefix -= 1;
    }
    while !full.is_char_boundary(end) {
        end += 1;
    }
    if end <= prefix {
        return None;
    }
    let closing = [closing, closing.trim_end()].into_iter().find(|c| !c.is_empty() && full[end..].starts_with(c));
    Some((prefix, end + closing.map_or(0, str::len)))
}

fn common_len(a: impl Iterator<Item = u8>, b: impl Iterator<Item = u8>) -> usize {
    a.zip(b).take_while(|(x, y)| x == y).count()
}

/// What the template writes after an assistant turn's text (`<|im_end|>\n` for ChatML), from a
/// conversation of one question and one answer.
fn turn_closing(render: &dyn Fn(&[ChatMessage]) -> Result<String>) -> Result<String> {
    let text = render(&[ChatMessage::new("user", "q"), ChatMessage::new("assistant", MARKER)])?;
    Ok(text.rsplit_once(MARKER).map(|(_, after)| after.to_string()).unwrap_or_default())
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
    /// writes its `reasoning_content` in a think block, and the last turn always has one (empty
    /// without thinking); earlier turns' thinking is dropped.
    const THINKING_TEMPLATE: &str = "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' and loop.index0 > ns.last_user and (loop.last or m.reasoning_content) %}<think>{{ m.reasoning_content or '' }}</think>{% endif %}{{ m.content }}</>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";

    #[test]
    fn a_turns_thinking_trains_where_the_template_writes_it_and_is_refused_where_it_would_be_dropped() {
        let thinking = ChatTemplate::new(THINKING_TEMPLATE, None, None).unwrap();
        let row =
            json!({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "add"}]});
        assert_eq!(shown(&thinking, row.clone(), TrainOn::Auto), "[<user>2+2?</><assistant>]<think>add</think>4</>");
        // Earlier turns' thinking is the template's to drop, and their answers still train:
        // found where the whole changes with them, since alone they render as a last turn.
        let mut two = row.clone();
        two["messages"]
            .as_array_mut()
            .unwrap()
            .extend([json!({"role": "user", "content": "3+3?"}), json!({"role": "assistant", "content": "6", "reasoning": "add"})]);
        assert_eq!(
            shown(&thinking, two.clone(), TrainOn::Completion),
            "[<user>2+2?</><assistant>4</><user>3+3?</><assistant>]<think>add</think>6</>"
        );
        assert_eq!(shown(&thinking, two, TrainOn::Auto), "[<user>2+2?</><assistant>]4</>[<user>3+3?</><assistant>]<think>add</think>6</>");
        let plain = ChatTemplate::new("{% for m in messages %}<{{ m.role }}>{{ m.content }}</>{% endfor %}", None, None).unwrap();
        let Example::Chat(chat) = parse_row(&row, true).unwrap() else { panic!("a chat row") };
        let decode = |ids: &[u32]| -> Result<String> { Ok(ids.iter().map(|&i| i as u8 as char).collect()) };
        let tools = TextTools { encode: &bytes, decode: &decode, template: Some(&plain), eos_id: None, pad_id: 0 };
        let e = format!("{:#}", chat_tokens(&chat, &tools, TrainOn::Auto).unwrap_err());
        assert!(e.contains("`reasoning_content` (or `reasoning`), but this model's chat template writes no thinking"), "{e}");
    }

    /// Multi-turn rows under a template that writes the last turn its own way (Qwen3's empty think
    /// block): every answer trains, with its end, calls included.
    #[test]
    fn every_turn_trains_under_a_template_that_writes_the_last_turn_its_own_way() {
        let thinking = ChatTemplate::new(THINKING_TEMPLATE, None, None).unwrap();
        let row = json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]});
        assert_eq!(shown(&thinking, row, TrainOn::Auto), "[<user>hi</><assistant>]hello</>[<user>bye</><assistant>]<think></think>ciao</>");
        let mut calls = weather_row();
        calls["messages"]
            .as_array_mut()
            .unwrap()
            .extend([json!({"role": "user", "content": "thanks"}), json!({"role": "assistant", "content": "bye"})]);
        let shown = shown(&thinking, calls, TrainOn::Auto);
        assert!(
            shown.ends_with("<user>weather?</><assistant>]<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}</tool_call></>[<user><tool_response>18C</tool_response></><assistant>]18C.</>[<user>thanks</><assistant>]<think></think>bye</>"),
            "{shown}"
        );
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
