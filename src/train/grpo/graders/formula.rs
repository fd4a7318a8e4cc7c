//! `multi`'s `calculate_output`: arithmetic over its graders' scores, as OpenAI writes it
//! (`+ - * /`, parentheses, numbers, grader names, and `min max abs floor ceil exp sqrt log`).

use anyhow::{bail, Context, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct Formula {
    root: Expr,
}

#[derive(Debug, Clone, PartialEq)]
enum Expr {
    Number(f64),
    /// The score of the grader at this index.
    Grader(usize),
    Neg(Box<Expr>),
    Binary(char, Box<Expr>, Box<Expr>),
    Call(String, Vec<Expr>),
}

const FUNCTIONS: &[(&str, usize)] = &[("min", 0), ("max", 0), ("abs", 1), ("floor", 1), ("ceil", 1), ("exp", 1), ("sqrt", 1), ("log", 1)];

impl Formula {
    /// Parses `text`; `names` are the graders it may name, by index.
    pub fn parse(text: &str, names: &[&str]) -> Result<Self> {
        let tokens = tokenize(text)?;
        let mut p = Parser { tokens: &tokens, at: 0, names, text };
        let root = p.sum()?;
        if p.at != tokens.len() {
            bail!("{text:?}: unexpected {:?}", tokens[p.at]);
        }
        Ok(Self { root })
    }

    /// The value with `scores[i]` for grader `i`.
    pub fn eval(&self, scores: &[f64]) -> f64 {
        eval(&self.root, scores)
    }
}

fn eval(e: &Expr, s: &[f64]) -> f64 {
    match e {
        Expr::Number(x) => *x,
        Expr::Grader(i) => s[*i],
        Expr::Neg(x) => -eval(x, s),
        Expr::Binary(op, a, b) => {
            let (a, b) = (eval(a, s), eval(b, s));
            match op {
                '+' => a + b,
                '-' => a - b,
                '*' => a * b,
                _ => a / b,
            }
        }
        Expr::Call(f, args) => {
            let v: Vec<f64> = args.iter().map(|a| eval(a, s)).collect();
            match f.as_str() {
                "min" => v.iter().copied().fold(f64::INFINITY, f64::min),
                "max" => v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                "abs" => v[0].abs(),
                "floor" => v[0].floor(),
                "ceil" => v[0].ceil(),
                "exp" => v[0].exp(),
                "sqrt" => v[0].sqrt(),
                _ => v[0].ln(),
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Number(f64),
    Name(String),
    Symbol(char),
}

fn tokenize(text: &str) -> Result<Vec<Token>> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = vec![];
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_digit() || c == '.' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_digit() || chars[i] == '.') {
                i += 1;
            }
            let s: String = chars[start..i].iter().collect();
            out.push(Token::Number(s.parse().with_context(|| format!("{text:?}: {s:?} is not a number"))?));
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(Token::Name(chars[start..i].iter().collect()));
        } else if "+-*/(),".contains(c) {
            out.push(Token::Symbol(c));
            i += 1;
        } else {
            bail!("{text:?}: unexpected character {c:?}");
        }
    }
    Ok(out)
}

struct Parser<'a> {
    tokens: &'a [Token],
    at: usize,
    names: &'a [&'a str],
    text: &'a str,
}

impl Parser<'_> {
    fn peek_symbol(&self, c: char) -> bool {
        self.tokens.get(self.at) == Some(&Token::Symbol(c))
    }

    fn sum(&mut self) -> Result<Expr> {
        let mut left = self.product()?;
        while let Some(op) = ['+', '-'].into_iter().find(|&c| self.peek_symbol(c)) {
            self.at += 1;
            left = Expr::Binary(op, Box::new(left), Box::new(self.product()?));
        }
        Ok(left)
    }

    fn product(&mut self) -> Result<Expr> {
        let mut left = self.unary()?;
        while let Some(op) = ['*', '/'].into_iter().find(|&c| self.peek_symbol(c)) {
            self.at += 1;
            left = Expr::Binary(op, Box::new(left), Box::new(self.unary()?));
        }
        Ok(left)
    }

    fn unary(&mut self) -> Result<Expr> {
        if self.peek_symbol('-') {
            self.at += 1;
            return Ok(Expr::Neg(Box::new(self.unary()?)));
        }
        self.atom()
    }

    fn atom(&mut self) -> Result<Expr> {
        let text = self.text;
        let token = self.tokens.get(self.at).cloned().with_context(|| format!("{text:?}: ends too early"))?;
        self.at += 1;
        match token {
            Token::Number(x) => Ok(Expr::Number(x)),
            Token::Symbol('(') => {
                let e = self.sum()?;
                self.expect(')')?;
                Ok(e)
            }
            Token::Name(name) if self.peek_symbol('(') => {
                let Some(&(_, arity)) = FUNCTIONS.iter().find(|(f, _)| *f == name) else {
                    bail!("{text:?}: `{name}` is not a function (min, max, abs, floor, ceil, exp, sqrt, log)");
                };
                self.at += 1;
                let mut args = vec![self.sum()?];
                while self.peek_symbol(',') {
                    self.at += 1;
                    args.push(self.sum()?);
                }
                self.expect(')')?;
                if arity != 0 && args.len() != arity {
                    bail!("{text:?}: {name} takes {arity} argument(s), got {}", args.len());
                }
                Ok(Expr::Call(name, args))
            }
            Token::Name(name) => match self.names.iter().position(|n| *n == name) {
                Some(i) => Ok(Expr::Grader(i)),
                None => bail!("{text:?}: `{name}` names no grader (graders: {})", self.names.join(", ")),
            },
            Token::Symbol(c) => bail!("{text:?}: unexpected {c:?}"),
        }
    }

    fn expect(&mut self, c: char) -> Result<()> {
        if !self.peek_symbol(c) {
            bail!("{:?}: expected {c:?}", self.text);
        }
        self.at += 1;
        Ok(())
    }
}
