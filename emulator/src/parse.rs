//! PTX text to decoded instructions: the module's entries, their parameters, registers,
//! shared and global variables, labels, and each instruction decoded (by `decode`) into the
//! closed set of forms in `inst`. Anything outside the subset is a `ParseError` naming the line.

use std::collections::HashMap;

use crate::decode;
use crate::inst::{Inst, Op, Slot, Special, Src};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("PTX line {line}: {message}")]
pub struct ParseError {
    pub line: usize,
    pub message: String,
}

pub(crate) fn err<T>(line: usize, message: impl Into<String>) -> Result<T, ParseError> {
    Err(ParseError {
        line,
        message: message.into(),
    })
}

/// A kernel parameter's declared type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    U64,
    U32,
    F32,
    /// `.b8 name[n]`.
    Bytes(u32),
}

impl ParamKind {
    /// Bytes of the parameter's value.
    pub fn size(self) -> u32 {
        match self {
            ParamKind::U64 => 8,
            ParamKind::U32 | ParamKind::F32 => 4,
            ParamKind::Bytes(n) => n,
        }
    }

    pub(crate) fn describe(self) -> String {
        match self {
            ParamKind::U64 => ".u64".into(),
            ParamKind::U32 => ".u32".into(),
            ParamKind::F32 => ".f32".into(),
            ParamKind::Bytes(n) => format!(".b8[{n}]"),
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Param {
    pub name: String,
    pub kind: ParamKind,
    /// Byte offset in the parameter buffer (each aligned as the ISA's `.param` layout).
    pub offset: u32,
}

/// A named address: what `mov.u64 %rd, name` gives and `[name]` means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SymKind {
    /// Offset in the parameter buffer.
    Param(u32),
    /// Offset in the block's shared memory (static arrays first, then the dynamic one).
    Shared(u32),
    /// The dynamic `.extern .shared` array (starts where the static ones end, aligned).
    Dynamic,
    /// A `.global` variable (zero-initialised, one per module and memory).
    Global { size: u32, align: u32 },
}

#[derive(Debug, Clone)]
pub(crate) struct Symbol {
    pub name: String,
    pub kind: SymKind,
}

#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub name: String,
    pub params: Vec<Param>,
    pub param_bytes: u32,
    pub symbols: Vec<Symbol>,
    /// Bytes of static shared memory.
    pub shared_static: u32,
    /// Alignment of the dynamic shared array.
    pub dyn_align: u32,
    /// Register slots per thread.
    pub slots: u32,
    /// Slots filled when a thread starts.
    pub specials: Vec<(Slot, Special)>,
    pub insts: Vec<Inst>,
}

/// A parsed PTX module: its entries, decoded.
#[derive(Debug, Clone, Default)]
pub struct Module {
    pub(crate) entries: Vec<Entry>,
}

impl Module {
    /// Parses PTX text; any instruction form the interpreter does not model is an error
    /// naming its line.
    pub fn parse(text: &str) -> Result<Module, ParseError> {
        let mut entries = Vec::new();
        // Module-scope variables (`.extern .shared` arrays, `.shared`, `.global`): every
        // later entry sees them.
        let mut globals: Vec<(usize, &str)> = Vec::new();
        let lines: Vec<(usize, &str)> = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.split("//").next().unwrap_or("").trim()))
            .collect();
        let mut i = 0;
        while i < lines.len() {
            let (no, l) = lines[i];
            i += 1;
            if l.is_empty()
                || l.starts_with(".version")
                || l.starts_with(".target")
                || l.starts_with(".address_size")
            {
                continue;
            }
            let l2 = l.strip_prefix(".visible").map(str::trim).unwrap_or(l);
            let Some(rest) = l2.strip_prefix(".entry") else {
                if [".extern", ".shared", ".global"]
                    .iter()
                    .any(|p| l.starts_with(p))
                {
                    globals.push((no, l.trim_end_matches(';')));
                    continue;
                }
                return err(no, format!("not modelled at module scope: `{l}`"));
            };
            let mut b = EntryBuilder::new(no, rest.trim())?;
            for &(gno, g) in &globals {
                b.directive(gno, g)?;
            }
            // The parameter list, up to `)`, then the body, `{` to `}`.
            let mut header = rest.split_once('(').map(|x| x.1).unwrap_or("").to_string();
            while !header.contains(')') {
                let Some(&(_, l)) = lines.get(i) else {
                    return err(no, "unterminated parameter list");
                };
                header.push_str(l);
                header.push(' ');
                i += 1;
            }
            let (plist, after) = header.split_once(')').unwrap_or((&header, ""));
            for p in plist.split(',').map(str::trim).filter(|p| !p.is_empty()) {
                b.param(no, p)?;
            }
            let mut opened = after.trim() == "{";
            let mut closed = false;
            while i < lines.len() && !closed {
                let (no, l) = lines[i];
                i += 1;
                if l.is_empty() {
                    continue;
                }
                if !opened {
                    if l != "{" {
                        return err(no, format!("expected `{{`, found `{l}`"));
                    }
                    opened = true;
                    continue;
                }
                if l == "}" {
                    closed = true;
                    continue;
                }
                b.line(no, l)?;
            }
            if !closed {
                return err(no, format!("entry `{}` has no closing `}}`", b.name));
            }
            entries.push(b.finish()?);
        }
        Ok(Module { entries })
    }

    /// The names of the module's entries, in order.
    pub fn entries(&self) -> Vec<&str> {
        self.entries.iter().map(|e| e.name.as_str()).collect()
    }

    /// The declared types of `entry`'s parameters, in order (what a launch must pass).
    pub fn params(&self, entry: &str) -> Option<Vec<ParamKind>> {
        self.entry(entry)
            .map(|e| e.params.iter().map(|p| p.kind).collect())
    }

    /// Bytes of `entry`'s static shared memory.
    pub fn static_shared(&self, entry: &str) -> Option<u32> {
        self.entry(entry).map(|e| e.shared_static)
    }

    pub(crate) fn entry(&self, name: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.name == name)
    }
}

/// One entry being parsed: its names so far.
pub(crate) struct EntryBuilder {
    name: String,
    line: usize,
    params: Vec<Param>,
    param_bytes: u32,
    symbols: Vec<Symbol>,
    sym_index: HashMap<String, usize>,
    shared_static: u32,
    dyn_align: u32,
    /// `%r<170>`: prefix to (first slot, count).
    reg_ranges: HashMap<String, (Slot, u32)>,
    regs: HashMap<String, Slot>,
    slots: u32,
    specials: Vec<(Slot, Special)>,
    special_slot: HashMap<Special, Slot>,
    insts: Vec<Inst>,
    labels: HashMap<String, u32>,
    /// Branches to patch: instruction index, label, line.
    branches: Vec<(usize, String, usize)>,
}

fn parse_uint(s: &str) -> Option<u64> {
    if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()
    } else {
        s.parse().ok()
    }
}

fn ident_ok(s: &str) -> bool {
    let mut c = s.chars();
    matches!(c.next(), Some(ch) if ch.is_ascii_alphabetic() || ch == '_' || ch == '$')
        && c.all(|ch| ch.is_ascii_alphanumeric() || ch == '_' || ch == '$')
}

impl EntryBuilder {
    fn new(line: usize, rest: &str) -> Result<EntryBuilder, ParseError> {
        let name = rest.split('(').next().unwrap_or("").trim().to_string();
        if !ident_ok(&name) {
            return err(line, format!("bad entry name `{name}`"));
        }
        Ok(EntryBuilder {
            name,
            line,
            params: Vec::new(),
            param_bytes: 0,
            symbols: Vec::new(),
            sym_index: HashMap::new(),
            shared_static: 0,
            dyn_align: 16,
            reg_ranges: HashMap::new(),
            regs: HashMap::new(),
            slots: 0,
            specials: Vec::new(),
            special_slot: HashMap::new(),
            insts: Vec::new(),
            labels: HashMap::new(),
            branches: Vec::new(),
        })
    }

    fn add_symbol(&mut self, line: usize, name: &str, kind: SymKind) -> Result<(), ParseError> {
        if !ident_ok(name) || self.sym_index.contains_key(name) {
            return err(line, format!("bad or repeated name `{name}`"));
        }
        self.sym_index.insert(name.to_string(), self.symbols.len());
        self.symbols.push(Symbol {
            name: name.to_string(),
            kind,
        });
        Ok(())
    }

    /// `.param .u64 name` or `.param .align 8 .b8 name[N]`; laid out in order, each at a
    /// multiple of its alignment (PTX ISA, "Kernel Function Parameters").
    fn param(&mut self, line: usize, p: &str) -> Result<(), ParseError> {
        let t: Vec<&str> = p.split_whitespace().collect();
        let (kind, align, name) = match t.as_slice() {
            [".param", ty, name] if !name.contains('[') => {
                let k = match *ty {
                    ".u64" | ".b64" | ".s64" => ParamKind::U64,
                    ".u32" | ".b32" | ".s32" => ParamKind::U32,
                    ".f32" => ParamKind::F32,
                    _ => return err(line, format!("parameter type not modelled: `{p}`")),
                };
                let a = if k == ParamKind::U64 { 8 } else { 4 };
                (k, a, *name)
            }
            [".param", ".align", a, ".b8", arr] => {
                let a: u32 = a.parse().unwrap_or(0);
                let (name, n) = arr.split_once('[').unwrap_or(("", ""));
                let n: u32 = n.trim_end_matches(']').parse().unwrap_or(0);
                if !a.is_power_of_two() || n == 0 {
                    return err(line, format!("bad parameter `{p}`"));
                }
                (ParamKind::Bytes(n), a, name)
            }
            _ => return err(line, format!("parameter not modelled: `{p}`")),
        };
        let offset = self.param_bytes.next_multiple_of(align);
        let size = match kind {
            ParamKind::U64 => 8,
            ParamKind::U32 | ParamKind::F32 => 4,
            ParamKind::Bytes(n) => n,
        };
        self.param_bytes = offset + size;
        self.add_symbol(line, name, SymKind::Param(offset))?;
        self.params.push(Param {
            name: name.to_string(),
            kind,
            offset,
        });
        Ok(())
    }

    fn line(&mut self, no: usize, l: &str) -> Result<(), ParseError> {
        for stmt in l.split(';').map(str::trim).filter(|s| !s.is_empty()) {
            let mut s = stmt;
            // Labels: `$L1:` (possibly before a statement).
            while let Some((lab, rest)) = s.split_once(':') {
                let lab = lab.trim();
                if !ident_ok(lab) || lab.contains(' ') {
                    break;
                }
                if self
                    .labels
                    .insert(lab.to_string(), self.insts.len() as u32)
                    .is_some()
                {
                    return err(no, format!("label `{lab}` defined twice"));
                }
                s = rest.trim();
            }
            if s.is_empty() {
                continue;
            }
            if s.starts_with('.') {
                self.directive(no, s)?;
            } else {
                let inst = decode::instruction(self, no, s)?;
                self.insts.push(inst);
            }
        }
        Ok(())
    }

    fn directive(&mut self, no: usize, s: &str) -> Result<(), ParseError> {
        let t: Vec<&str> = s.split_whitespace().collect();
        match t.as_slice() {
            [".reg", _ty, names @ ..] if !names.is_empty() => {
                for n in names.join(" ").split(',').map(str::trim) {
                    if let Some((prefix, count)) = n.split_once('<') {
                        let count: u32 = count.trim_end_matches('>').parse().unwrap_or(0);
                        self.reg_ranges
                            .insert(prefix.to_string(), (self.slots, count));
                        self.slots += count;
                    } else {
                        self.regs.insert(n.to_string(), self.slots);
                        self.slots += 1;
                    }
                }
                Ok(())
            }
            [space @ (".shared" | ".global"), ".align", a, ty, decl] => {
                let align: u32 = a.parse().unwrap_or(0);
                let elem = match *ty {
                    ".b8" | ".u8" | ".s8" => 1,
                    ".b16" | ".u16" | ".s16" | ".f16" | ".bf16" => 2,
                    ".b32" | ".u32" | ".s32" | ".f32" => 4,
                    ".b64" | ".u64" | ".s64" | ".f64" => 8,
                    _ => return err(no, format!("variable type not modelled: `{s}`")),
                };
                let (name, n) = match decl.split_once('[') {
                    Some((name, n)) => (name, n.trim_end_matches(']').parse::<u32>().ok()),
                    None => (*decl, Some(1)),
                };
                let Some(n) = n.filter(|_| align.is_power_of_two()) else {
                    return err(no, format!("bad variable declaration `{s}`"));
                };
                let size = n.saturating_mul(elem);
                if *space == ".shared" {
                    let off = self.shared_static.next_multiple_of(align);
                    self.shared_static = off.saturating_add(size);
                    self.add_symbol(no, name, SymKind::Shared(off))
                } else {
                    self.add_symbol(no, name, SymKind::Global { size, align })
                }
            }
            [".extern", ".shared", ".align", a, _ty, decl] if decl.ends_with("[]") => {
                self.dyn_align = a.parse().unwrap_or(16).max(1);
                self.add_symbol(no, decl.trim_end_matches("[]"), SymKind::Dynamic)
            }
            _ => err(no, format!("directive not modelled: `{s}`")),
        }
    }

    fn special(&mut self, sp: Special) -> Slot {
        if let Some(&s) = self.special_slot.get(&sp) {
            return s;
        }
        let s = self.slots;
        self.slots += 1;
        self.specials.push((s, sp));
        self.special_slot.insert(sp, s);
        s
    }

    /// A register, special register or symbol name to its slot.
    pub(crate) fn reg(&mut self, no: usize, name: &str) -> Result<Slot, ParseError> {
        if let Some(&s) = self.regs.get(name) {
            return Ok(s);
        }
        if let Some(rest) = name.strip_prefix('%') {
            let dim = |d: &str| match d {
                "x" => Some(0),
                "y" => Some(1),
                "z" => Some(2),
                _ => None,
            };
            let sp = match rest.split_once('.') {
                Some((r, d)) => dim(d).and_then(|d| match r {
                    "tid" => Some(Special::Tid(d)),
                    "ntid" => Some(Special::Ntid(d)),
                    "ctaid" => Some(Special::Ctaid(d)),
                    "nctaid" => Some(Special::Nctaid(d)),
                    _ => None,
                }),
                None if rest == "laneid" => Some(Special::LaneId),
                None if rest == "warpid" => Some(Special::WarpId),
                None => None,
            };
            if let Some(sp) = sp {
                return Ok(self.special(sp));
            }
            let digits = name.trim_end_matches(|c: char| c.is_ascii_digit());
            if let (Some(&(base, count)), Ok(i)) = (
                self.reg_ranges.get(digits),
                name[digits.len()..].parse::<u32>(),
            ) {
                if i < count {
                    return Ok(base + i);
                }
            }
            return err(no, format!("undeclared register `{name}`"));
        }
        match self.sym_index.get(name) {
            Some(&i) => Ok(self.special(Special::Symbol(i))),
            None => err(no, format!("unknown name `{name}`")),
        }
    }

    /// A source operand: register, special, symbol or immediate (`0f`/`0d` hex floats,
    /// decimal or `0x` integers).
    pub(crate) fn src(&mut self, no: usize, s: &str) -> Result<Src, ParseError> {
        let s = s.trim();
        let hex = |h: &str, n: usize| {
            (h.len() == n)
                .then(|| u64::from_str_radix(h, 16).ok())
                .flatten()
        };
        if let Some(v) = s
            .strip_prefix("0f")
            .or_else(|| s.strip_prefix("0F"))
            .and_then(|h| hex(h, 8))
        {
            return Ok(Src::Imm(v));
        }
        if let Some(v) = s
            .strip_prefix("0d")
            .or_else(|| s.strip_prefix("0D"))
            .and_then(|h| hex(h, 16))
        {
            return Ok(Src::Imm(v));
        }
        if let Some(v) = s.strip_prefix('-') {
            if let Some(v) = parse_uint(v) {
                return Ok(Src::Imm(v.wrapping_neg()));
            }
        }
        if let Some(v) = parse_uint(s) {
            return Ok(Src::Imm(v));
        }
        Ok(Src::Reg(self.reg(no, s)?))
    }

    pub(crate) fn dst(&mut self, no: usize, s: &str) -> Result<Slot, ParseError> {
        match self.src(no, s)? {
            Src::Reg(r) => Ok(r),
            Src::Imm(_) => err(no, format!("`{s}` is not a register")),
        }
    }

    /// `[reg]`, `[reg+N]`, `[reg+-N]`, `[name]`, `[name+N]`.
    pub(crate) fn addr(&mut self, no: usize, s: &str) -> Result<crate::inst::Addr, ParseError> {
        let Some(inner) = s.trim().strip_prefix('[').and_then(|x| x.strip_suffix(']')) else {
            return err(no, format!("`{s}` is not an address"));
        };
        let (base, off) = match inner.split_once('+') {
            Some((b, o)) => {
                let o = o.trim();
                let v = match o.strip_prefix('-') {
                    Some(n) => parse_uint(n).map(|n| (n as i64).wrapping_neg()),
                    None => parse_uint(o).map(|n| n as i64),
                };
                match v {
                    Some(v) => (b.trim(), v),
                    None => return err(no, format!("bad address offset in `{s}`")),
                }
            }
            None => (inner.trim(), 0),
        };
        Ok(crate::inst::Addr {
            base: self.reg(no, base)?,
            offset: off,
        })
    }

    pub(crate) fn branch(&mut self, no: usize, label: &str) -> Op {
        self.branches
            .push((self.insts.len(), label.trim().to_string(), no));
        Op::Bra { target: 0 }
    }

    fn finish(mut self) -> Result<Entry, ParseError> {
        for (i, label, no) in std::mem::take(&mut self.branches) {
            let Some(&t) = self.labels.get(&label) else {
                return err(no, format!("unknown label `{label}`"));
            };
            if let Some(Inst {
                op: Op::Bra { target },
                ..
            }) = self.insts.get_mut(i)
            {
                *target = t;
            }
        }
        let _ = self.line;
        Ok(Entry {
            name: self.name,
            params: self.params,
            param_bytes: self.param_bytes,
            symbols: self.symbols,
            shared_static: self.shared_static,
            dyn_align: self.dyn_align,
            slots: self.slots,
            specials: self.specials,
            insts: self.insts,
        })
    }
}
