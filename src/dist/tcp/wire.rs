//! The `tcp` backend's wire format: length-prefixed frames, a request per collective (an op
//! byte, its arguments, its data as little-endian floats or bytes) and its reply.

use std::io::{Read, Write};

use anyhow::{bail, Result};

pub(super) const MAGIC: u32 = 0x4653_4450; // "FSDP"

#[repr(u8)]
#[derive(Clone, Copy)]
pub(super) enum Op {
    AllGather = 1,
    ReduceScatter = 2,
    AllReduce = 3,
    AllReduceF64 = 4,
    Scatter = 5,
    Broadcast = 6,
    Barrier = 7,
    Abort = 8,
    Bye = 9,
}

/// A length-prefixed little-endian message being built.
#[derive(Default)]
pub(super) struct Msg(pub(super) Vec<u8>);

impl Msg {
    pub(super) fn u8(mut self, x: u8) -> Self {
        self.0.push(x);
        self
    }
    pub(super) fn u64(mut self, x: u64) -> Self {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    pub(super) fn bytes(self, b: &[u8]) -> Self {
        let mut s = self.u64(b.len() as u64);
        s.0.extend_from_slice(b);
        s
    }
    pub(super) fn f32s(self, v: &[f32]) -> Self {
        let mut s = self.u64(v.len() as u64);
        s.0.reserve(v.len() * 4);
        for x in v {
            s.0.extend_from_slice(&x.to_le_bytes());
        }
        s
    }
    pub(super) fn f64s(self, v: &[f64]) -> Self {
        let mut s = self.u64(v.len() as u64);
        for x in v {
            s.0.extend_from_slice(&x.to_le_bytes());
        }
        s
    }
}

/// Reads a message built by [`Msg`].
pub(super) struct Reader<'a> {
    pub(super) b: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            bail!("truncated message");
        }
        let (a, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(a)
    }
    pub(super) fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub(super) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub(super) fn bytes(&mut self) -> Result<Vec<u8>> {
        let n = self.u64()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    pub(super) fn f32s(&mut self) -> Result<Vec<f32>> {
        let n = self.u64()? as usize;
        Ok(self.take(n * 4)?.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect())
    }
    pub(super) fn f64s(&mut self) -> Result<Vec<f64>> {
        let n = self.u64()? as usize;
        Ok(self.take(n * 8)?.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect())
    }
}

pub(super) fn write_frame(w: &mut impl Write, payload: &[u8]) -> std::io::Result<()> {
    w.write_all(&(payload.len() as u64).to_le_bytes())?;
    w.write_all(payload)?;
    w.flush()
}

/// A little-endian u64 (a frame's length, a vector's count) from the socket.
pub(super) fn read_u64(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// `n` bytes from the socket, as a vector.
pub(super) fn read_bytes(r: &mut impl Read, n: usize) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; n];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

pub(super) fn read_frame(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let len = read_u64(r)? as usize;
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// Reads one request of a remote rank (on rank 0). A gather's or a reduction's f32 values are
/// read from the socket straight into their vector: through a frame first, each remote rank's
/// unit-sized request was held twice while it was decoded, and three ranks' at once set rank
/// 0's peak. Other requests are read as a frame and decoded.
pub(super) fn read_request(r: &mut impl Read) -> std::io::Result<Result<(u8, Request)>> {
    let len = read_u64(r)? as usize;
    let mut head = [0u8; 2];
    if len >= 10 {
        r.read_exact(&mut head)?;
        let carries_f32s = [Op::AllGather, Op::ReduceScatter, Op::AllReduce].iter().any(|&o| o as u8 == head[0]);
        let count = read_u64(r)?;
        let n = count as usize;
        if carries_f32s && n.checked_mul(4) == Some(len - 10) {
            let values = read_f32s(r, n)?;
            let req = match head[0] {
                x if x == Op::AllGather as u8 => Request::AllGather(values),
                x if x == Op::ReduceScatter as u8 => Request::ReduceScatter(values),
                _ => Request::AllReduce(values),
            };
            return Ok(Ok((head[1], req)));
        }
        let mut frame = Vec::with_capacity(len);
        frame.extend_from_slice(&head);
        frame.extend_from_slice(&count.to_le_bytes());
        frame.resize(len, 0);
        r.read_exact(&mut frame[10..])?;
        return Ok(decode(&frame));
    }
    Ok(decode(&read_bytes(r, len)?))
}

/// `n` little-endian f32 values (as `Msg` writes them) read from the socket straight into
/// their vector.
pub(super) fn read_f32s(r: &mut impl Read, n: usize) -> std::io::Result<Vec<f32>> {
    let mut values = vec![0f32; n];
    // SAFETY: any bytes are a valid f32; the slice covers exactly `values`' n values.
    r.read_exact(unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<u8>(), n * 4) })?;
    values.iter_mut().for_each(|x| *x = f32::from_bits(u32::from_le(x.to_bits())));
    Ok(values)
}

/// A frame of `head` then f32 values as `Msg::f32s` lays them out, written from the values
/// themselves in small pieces (no serialised copy of a possibly unit-sized payload).
pub(super) fn write_f32s_frame(w: &mut impl Write, head: &[u8], values: &[f32]) -> std::io::Result<()> {
    let len = head.len() as u64 + 8 + 4 * values.len() as u64;
    w.write_all(&len.to_le_bytes())?;
    w.write_all(head)?;
    w.write_all(&(values.len() as u64).to_le_bytes())?;
    for chunk in values.chunks(1 << 14) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.write_all(&bytes)?;
    }
    w.flush()
}

/// One request of a remote rank, decoded (the relay holds one copy of the data while the
/// collective runs: see [`read_request`]).
pub(super) enum Request {
    AllGather(Vec<f32>),
    ReduceScatter(Vec<f32>),
    AllReduce(Vec<f32>),
    AllReduceF64(Vec<f64>),
    Scatter { root: usize, chunks: Option<Vec<Vec<f32>>> },
    Broadcast { root: usize, bytes: Option<Vec<u8>> },
    Barrier,
    Abort(String),
    Bye,
}

pub(super) fn decode(frame: &[u8]) -> Result<(u8, Request)> {
    let mut r = Reader { b: frame };
    let op = r.u8()?;
    let group = r.u8()?;
    let req = match op {
        x if x == Op::AllGather as u8 => Request::AllGather(r.f32s()?),
        x if x == Op::ReduceScatter as u8 => Request::ReduceScatter(r.f32s()?),
        x if x == Op::AllReduce as u8 => Request::AllReduce(r.f32s()?),
        x if x == Op::AllReduceF64 as u8 => Request::AllReduceF64(r.f64s()?),
        x if x == Op::Scatter as u8 => {
            let root = r.u64()? as usize;
            let chunks = if r.u8()? == 1 {
                let n = r.u64()? as usize;
                Some((0..n).map(|_| r.f32s()).collect::<Result<Vec<_>>>()?)
            } else {
                None
            };
            Request::Scatter { root, chunks }
        }
        x if x == Op::Broadcast as u8 => {
            let root = r.u64()? as usize;
            Request::Broadcast { root, bytes: if r.u8()? == 1 { Some(r.bytes()?) } else { None } }
        }
        x if x == Op::Barrier as u8 => Request::Barrier,
        // The proxied rank's handles name it in the message.
        x if x == Op::Abort as u8 => Request::Abort(String::from_utf8_lossy(&r.bytes()?).to_string()),
        x if x == Op::Bye as u8 => Request::Bye,
        other => bail!("unknown operation {other}"),
    };
    Ok((group, req))
}

/// A success reply carrying f32 values (status 0, then the values).
pub(super) fn write_f32_reply(w: &mut impl Write, values: &[f32]) -> std::io::Result<()> {
    write_f32s_frame(w, &[0u8], values)
}

/// A reply to a collective that carries f32 values, read straight into their vector as
/// [`read_request`] reads requests: an error reply is the error it carries.
pub(super) fn read_f32_reply(r: &mut impl Read) -> std::io::Result<Result<Vec<f32>>> {
    let len = read_u64(r)? as usize;
    let mut status = [0u8; 1];
    r.read_exact(&mut status)?;
    if status[0] != 0 || len < 9 {
        let rest = read_bytes(r, len.saturating_sub(1))?;
        let why = (Reader { b: &rest }).bytes().map(|b| String::from_utf8_lossy(&b).to_string());
        return Ok(Err(anyhow::anyhow!("{}", why.unwrap_or_else(|e| format!("a malformed reply ({e})")))));
    }
    let n = read_u64(r)? as usize;
    if n.checked_mul(4) != Some(len - 9) {
        // The rest of the frame is read, so the connection stays in step.
        read_bytes(r, len - 9)?;
        return Ok(Err(anyhow::anyhow!("a reply of {n} values in {} bytes: truncated message", len - 9)));
    }
    Ok(Ok(read_f32s(r, n)?))
}
