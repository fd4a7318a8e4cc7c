//! GBNF grammars (llama.cpp's format, which vLLM's docs and xgrammar use too) written as the
//! grammar engine's Lark syntax, so that a `grammar` a llama.cpp or vLLM user sends works here.
//!
//! GBNF: rules `name ::= body`, a body of names, "strings" (with `\n \t \r \\ \" \[ \] \xHH
//! \uHHHH \UHHHHHHHH` escapes), character classes `[a-z]` / `[^"\\]`, `.` (any character),
//! groups `( )`, alternatives `|`, repetitions `* + ? {m} {m,} {m,n}`, and `#` comments; the
//! grammar starts at `root`. A rule runs until the next `name ::=`, whatever its lines.
//!
//! In the output each rule is one line; `root` becomes Lark's `start`; names Lark would read as
//! terminals (upper case) or not as names (a leading digit) are renamed; strings are written as
//! JSON strings (the engine's string syntax) and character classes as regexes of `\x{..}`
//! escapes, so no character of the input can mean something else in Lark's regex syntax.

use std::collections::HashMap;
use std::fmt::Write;

use anyhow::{bail, Context, Result};

/// Whether `grammar` is GBNF rather than Lark: a line (comments aside) defines a rule with `::=`
/// (vLLM tells the two apart the same way).
pub fn is_gbnf(grammar: &str) -> bool {
    grammar.lines().any(|line| line.split('#').next().unwrap_or("").contains("::="))
}

/// `grammar` (GBNF) in the engine's Lark syntax. Errors name the line and what is wrong there.
pub fn to_lark(grammar: &str) -> Result<String> {
    let tokens = lex(grammar)?;
    let rules = split_rules(&tokens)?;
    let names = lark_names(&rules);
    if !names.contains_key("root") {
        bail!("the GBNF grammar has no `root` rule (where it starts)");
    }
    let mut out = String::new();
    for (name, body) in &rules {
        let _ = write!(out, "{}:", names[*name]);
        let mut alternative_empty = true;
        for (token, line) in body.iter() {
            let text = match token {
                Token::Name(n) => names.get(n.as_str()).with_context(|| format!("line {line}: no rule is named `{n}`"))?.clone(),
                Token::Literal(s) => serde_json::to_string(s)?,
                Token::Class { negated, items } => class_regex(*negated, items),
                Token::Any => "/(?s:.)/".to_string(),
                Token::Op(op) => op.clone(),
                Token::Defines => unreachable!("split_rules ends a body before `::=`"),
            };
            // An empty alternative (`a ::= "x" |`) matches nothing: the empty string.
            if matches!(token, Token::Op(op) if op == "|" || op == ")") && alternative_empty {
                out.push_str(" \"\"");
            }
            alternative_empty = matches!(token, Token::Op(op) if op == "|" || op == "(");
            let _ = write!(out, " {text}");
        }
        if alternative_empty {
            out.push_str(" \"\"");
        }
        out.push('\n');
    }
    Ok(out)
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Name(String),
    Defines,
    Literal(String),
    Class {
        negated: bool,
        items: Vec<(char, char)>,
    },
    Any,
    /// `( ) | * + ?` or a `{m,n}` repetition, written as it is.
    Op(String),
}

/// The tokens of `grammar`, each with its line (1-based).
fn lex(grammar: &str) -> Result<Vec<(Token, usize)>> {
    let mut tokens = vec![];
    let mut chars = grammar.chars().peekable();
    let mut line = 1;
    while let Some(c) = chars.next() {
        let token = match c {
            '\n' => {
                line += 1;
                continue;
            }
            c if c.is_whitespace() => continue,
            '#' => {
                while chars.next_if(|&c| c != '\n').is_some() {}
                continue;
            }
            ':' => {
                if !(chars.next_if_eq(&':').is_some() && chars.next_if_eq(&'=').is_some()) {
                    bail!("line {line}: `:` that does not begin `::=`");
                }
                Token::Defines
            }
            '"' => {
                let mut s = String::new();
                loop {
                    match chars.next() {
                        None | Some('\n') => bail!("line {line}: a string that does not end"),
                        Some('"') => break,
                        Some('\\') => s.push(escape(&mut chars, line)?),
                        Some(c) => s.push(c),
                    }
                }
                Token::Literal(s)
            }
            '[' => {
                let negated = chars.next_if_eq(&'^').is_some();
                let mut items = vec![];
                loop {
                    let first = match chars.next() {
                        None | Some('\n') => bail!("line {line}: a character class that does not end"),
                        Some(']') => break,
                        Some('\\') => escape(&mut chars, line)?,
                        Some(c) => c,
                    };
                    // `a-z`, unless the `-` is the class's last character.
                    let mut last = first;
                    if chars.peek() == Some(&'-') {
                        let mut ahead = chars.clone();
                        ahead.next();
                        if !matches!(ahead.peek(), Some(']') | None) {
                            chars.next();
                            last = match chars.next() {
                                Some('\\') => escape(&mut chars, line)?,
                                Some(c) => c,
                                None => bail!("line {line}: a character class that does not end"),
                            };
                            if last < first {
                                bail!("line {line}: the range `{first}-{last}` runs backwards");
                            }
                        }
                    }
                    items.push((first, last));
                }
                Token::Class { negated, items }
            }
            '.' => Token::Any,
            '(' | ')' | '|' | '*' | '+' | '?' => Token::Op(c.to_string()),
            '{' => {
                let mut inner = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(c) if c.is_ascii_digit() || c == ',' || c == ' ' => inner.push(c),
                        _ => bail!("line {line}: a repetition must be {{m}}, {{m,}} or {{m,n}}"),
                    }
                }
                let inner: String = inner.split_whitespace().collect();
                if inner.is_empty() || inner.matches(',').count() > 1 || inner == "," {
                    bail!("line {line}: a repetition must be {{m}}, {{m,}} or {{m,n}}");
                }
                Token::Op(format!("{{{inner}}}"))
            }
            c if is_name_char(c) => {
                let mut name = c.to_string();
                while let Some(c) = chars.next_if(|&c| is_name_char(c)) {
                    name.push(c);
                }
                Token::Name(name)
            }
            '<' => bail!("line {line}: token references (`<...>`) are not supported in GBNF grammars here"),
            c => bail!("line {line}: unexpected `{c}`"),
        };
        tokens.push((token, line));
    }
    Ok(tokens)
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

/// The character an escape stands for (the `\` already read).
fn escape(chars: &mut std::iter::Peekable<std::str::Chars>, line: usize) -> Result<char> {
    let hex = |chars: &mut std::iter::Peekable<std::str::Chars>, n: usize| -> Result<char> {
        let digits: String = (0..n).filter_map(|_| chars.next_if(char::is_ascii_hexdigit)).collect();
        let code = u32::from_str_radix(&digits, 16).ok().filter(|_| digits.len() == n);
        code.and_then(char::from_u32).with_context(|| format!("line {line}: a bad {n}-digit hex escape"))
    };
    Ok(match chars.next() {
        Some('n') => '\n',
        Some('t') => '\t',
        Some('r') => '\r',
        Some('x') => hex(chars, 2)?,
        Some('u') => hex(chars, 4)?,
        Some('U') => hex(chars, 8)?,
        Some(c @ ('\\' | '"' | '[' | ']' | '-' | '^')) => c,
        Some(c) => bail!("line {line}: unknown escape `\\{c}`"),
        None => bail!("line {line}: `\\` at the end"),
    })
}

/// A rule's name and its body's tokens, each with its line.
type Rule<'a> = (&'a str, &'a [(Token, usize)]);

/// The rules, in order: each name and its body (the tokens up to the next `name ::=`).
fn split_rules(tokens: &[(Token, usize)]) -> Result<Vec<Rule<'_>>> {
    let starts: Vec<usize> = (0..tokens.len())
        .filter(|&i| matches!(tokens[i].0, Token::Name(_)) && tokens.get(i + 1).is_some_and(|t| t.0 == Token::Defines))
        .collect();
    match (starts.first(), tokens.first()) {
        (_, None) => bail!("the grammar is empty"),
        (Some(0), _) => {}
        (_, Some((_, line))) => bail!("line {line}: a grammar begins with a rule, `name ::= ...`"),
    }
    let mut rules: Vec<Rule> = vec![];
    for (k, &start) in starts.iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(tokens.len());
        let Token::Name(name) = &tokens[start].0 else { unreachable!() };
        let body = &tokens[start + 2..end];
        if let Some((_, line)) = body.iter().find(|t| t.0 == Token::Defines) {
            bail!("line {line}: `::=` without a rule name before it");
        }
        if rules.iter().any(|(n, _)| n == name) {
            bail!("line {}: the rule `{name}` is defined twice", tokens[start].1);
        }
        rules.push((name, body));
    }
    Ok(rules)
}

/// Each GBNF rule's name in Lark: `root` is `start`; a lower-case name stays; others are renamed.
fn lark_names<'a>(rules: &[Rule<'a>]) -> HashMap<&'a str, String> {
    let valid = |n: &str| n != "start" && n.starts_with(|c: char| c.is_ascii_lowercase()) && !n.contains(|c: char| c.is_ascii_uppercase());
    rules
        .iter()
        .enumerate()
        .map(|(i, (name, _))| {
            let lark = match *name {
                "root" => "start".to_string(),
                n if valid(n) => n.to_string(),
                n => format!("r{i}-{}", n.to_ascii_lowercase()),
            };
            (*name, lark)
        })
        .collect()
}

/// A character class as a Lark regex, every character escaped.
fn class_regex(negated: bool, items: &[(char, char)]) -> String {
    let mut re = String::from(if negated { "/[^" } else { "/[" });
    for &(first, last) in items {
        let _ = write!(re, "\\x{{{:x}}}", first as u32);
        if last != first {
            let _ = write!(re, "-\\x{{{:x}}}", last as u32);
        }
    }
    re.push_str("]/");
    re
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::constraint::{Grammars, OutputFormat};

    /// llama.cpp's grammars/json.gbnf, as it ships.
    const JSON: &str = r#"
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"#;

    /// vLLM's structured-outputs example (underscored names, as xgrammar takes them).
    const SQL: &str = r#"
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"#;

    /// Whether the grammar engine, given `lark`, accepts `text` whole.
    fn accepts(lark: &str, text: &str) -> bool {
        let tok = crate::fixtures::train_tokenizer().unwrap();
        let eos = tok.token_to_id("<|im_end|>").unwrap();
        let grammars = Grammars::new(&tok.to_string(false).unwrap(), tok.get_vocab_size(true), eos).unwrap();
        let mut m = grammars.matcher(&OutputFormat::Lark(lark.to_string())).unwrap_or_else(|e| panic!("{e}: {lark}"));
        let ids = m.tok_env().unwrap().tokenize_bytes(text.as_bytes());
        m.validate_tokens(&ids).unwrap() == ids.len() && m.consume_tokens(&ids).is_ok() && m.is_accepting().unwrap()
    }

    #[test]
    fn llama_cpps_json_grammar_accepts_json_and_nothing_else() {
        assert!(is_gbnf(JSON) && !is_gbnf("start: \"a\" # x ::= y"));
        let lark = to_lark(JSON).unwrap();
        assert!(lark.starts_with("start:"), "{lark}");
        assert!(accepts(&lark, r#"{"a": [1, -2.5e3, "x\"y", true, null], "b": {}}"#), "{lark}");
        assert!(accepts(&lark, "{\n  \"k\": \"v\\u00e9\"}"), "{lark}");
        assert!(!accepts(&lark, r#"{"a": 01}"#) && !accepts(&lark, "[1]") && !accepts(&lark, r#"{"a": "x"#), "{lark}");
    }

    #[test]
    fn vllms_sql_example_holds_the_answer_to_its_words() {
        let lark = to_lark(SQL).unwrap();
        assert!(accepts(&lark, "SELECT col_2  from table_1  where col_1 = 2 "), "{lark}");
        assert!(!accepts(&lark, "SELECT col_3  from table_1  where col_1 = 2 "), "{lark}");
    }

    #[test]
    fn names_lark_reads_otherwise_are_renamed_and_escapes_kept() {
        let lark = to_lark("root ::= Greeting 2x\nGreeting ::= \"hi\\t\" [\\]a-c]\n2x ::= \"/\" | \n").unwrap();
        assert!(!lark.contains("Greeting") && !lark.contains(" 2x"), "{lark}");
        assert!(accepts(&lark, "hi\t]/") && accepts(&lark, "hi\tb") && !accepts(&lark, "hi\td"), "{lark}");
    }

    #[test]
    fn bad_grammars_are_named_by_line() {
        let err = |g: &str| to_lark(g).unwrap_err().to_string();
        assert_eq!(err("root ::= x"), "line 1: no rule is named `x`");
        assert_eq!(err("a ::= \"x\""), "the GBNF grammar has no `root` rule (where it starts)");
        assert_eq!(err("root ::= \"x\"\nroot ::= \"y\""), "line 2: the rule `root` is defined twice");
        assert_eq!(err("root ::= \"x\n"), "line 1: a string that does not end");
        assert_eq!(err("root ::= [z-a]"), "line 1: the range `z-a` runs backwards");
        assert_eq!(err("root ::= \"\\q\""), "line 1: unknown escape `\\q`");
        assert_eq!(err("\n\"x\" root ::= \"y\""), "line 2: a grammar begins with a rule, `name ::= ...`");
        assert_eq!(err("root ::= <|eot|>"), "line 1: token references (`<...>`) are not supported in GBNF grammars here");
    }
}
