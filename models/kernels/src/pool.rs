//! The thread pool: our parallel loops run on candle's barrier pool, the pool candle's own ops
//! and our matrix products run on, the calling thread working too. Each helper hands every
//! thread disjoint pieces of the buffers it borrows ([`DisjointWrites`]). One pool, not two:
//! with rayon's beside candle's, threads spin against each other for the same cores (why, with
//! the profile, in docs/design.md).

use crate::disjoint::DisjointWrites;

/// Buffers of at most this many values are filled on the calling thread alone: a decoding
/// step's norms, rotations and SwiGLU are a few hundred values, less work than a region's
/// handshake (the other threads woken, then waited for) costs (docs/design.md, "Small
/// elementwise ops on the calling thread").
const INLINE_MAX_VALUES: usize = 1 << 12;

/// Piece `c` of `chunk` places (the last shorter) of a buffer of `len`.
fn piece_range(c: usize, chunk: usize, len: usize) -> std::ops::Range<usize> {
    c * chunk..((c + 1) * chunk).min(len)
}

/// Runs `f(c, piece)` for every `chunk`-long piece `c` of `out` (the last may be shorter) on
/// candle's barrier pool, the calling thread included. Training's elementwise ops run here, on
/// the pool their matrix products run on: rayon's threads beside it spin against it for the
/// same cores.
pub fn pool_chunks_mut<T: Send>(out: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let len = out.len();
    let base = DisjointWrites::new(out);
    candle_core::utils::barrier_pool().execute_chunked(len.div_ceil(chunk.max(1)), |range| {
        for c in range {
            // SAFETY: piece c goes to this thread only.
            f(c, unsafe { base.piece(piece_range(c, chunk, len)) })
        }
    })
}

/// [`pool_chunks_mut`] over two buffers cut into the same number of pieces (`a` in pieces of
/// `chunk_a`, `b` of `chunk_b`).
pub fn pool_chunks_mut2<T: Send, U: Send>(
    (a, chunk_a): (&mut [T], usize),
    (b, chunk_b): (&mut [U], usize),
    f: impl Fn(usize, &mut [T], &mut [U]) + Sync,
) {
    let pieces = a.len().div_ceil(chunk_a.max(1));
    assert_eq!(pieces, b.len().div_ceil(chunk_b.max(1)), "pool_chunks_mut2: the buffers cut into different numbers of pieces");
    let (len_a, len_b) = (a.len(), b.len());
    let (pa, pb) = (DisjointWrites::new(a), DisjointWrites::new(b));
    candle_core::utils::barrier_pool().execute_chunked(pieces, |range| {
        for c in range {
            // SAFETY: piece c of both buffers goes to this thread only.
            f(c, unsafe { pa.piece(piece_range(c, chunk_a, len_a)) }, unsafe { pb.piece(piece_range(c, chunk_b, len_b)) })
        }
    })
}

/// [`pool_chunks_mut`] that keeps what `f` returns for each piece, in piece order.
pub fn pool_map_chunks_mut<T: Send, R: Send + Sync>(out: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) -> R + Sync) -> Vec<R> {
    let slots: Vec<std::sync::OnceLock<R>> = (0..out.len().div_ceil(chunk.max(1))).map(|_| std::sync::OnceLock::new()).collect();
    pool_chunks_mut(out, chunk, |c, piece| {
        let _ = slots[c].set(f(c, piece));
    });
    slots.into_iter().map(|s| s.into_inner().expect("every piece ran")).collect()
}

/// A new buffer of `len` values that `f(c, piece)` fills as [`pool_map_chunks_mut`] would fill
/// `vec![0.0; len]`, keeping what `f` returns per piece: each thread zeroes its own piece just
/// before handing it to `f`. `vec![0.0; len]` was a memset on the calling thread alone while the
/// pool's other threads spun (docs/design.md),
/// and then a second pass over the buffer; a piece zeroed by its own thread is in its cache when
/// `f` writes it. The buffer has room for `room_after` more values, which the caller pushes (a
/// gradient's column sums after its rows) without moving it.
pub fn pool_map_new<R: Send + Sync>(
    len: usize,
    room_after: usize,
    chunk: usize,
    f: impl Fn(usize, &mut [f32]) -> R + Sync,
) -> (Vec<f32>, Vec<R>) {
    let chunk = chunk.max(1);
    let mut out: Vec<f32> = Vec::with_capacity(len + room_after);
    let slots: Vec<std::sync::OnceLock<R>> = (0..len.div_ceil(chunk)).map(|_| std::sync::OnceLock::new()).collect();
    let base = DisjointWrites::spare(&mut out, len);
    let fill = |range: std::ops::Range<usize>| {
        for c in range {
            // SAFETY: piece c goes to this thread only (zeroed by it first).
            let piece = unsafe { base.zeroed(piece_range(c, chunk, len)) };
            let _ = slots[c].set(f(c, piece));
        }
    };
    match len <= INLINE_MAX_VALUES {
        true => fill(0..slots.len()),
        false => candle_core::utils::barrier_pool().execute_chunked(slots.len(), fill),
    }
    // SAFETY: every piece of the first `len` values was zeroed above (execute_chunked runs all).
    unsafe { out.set_len(len) };
    (out, slots.into_iter().map(|s| s.into_inner().expect("every piece ran")).collect())
}

/// [`pool_map_new`] with nothing kept per piece and no room after.
pub fn pool_new(len: usize, chunk: usize, f: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    pool_map_new(len, 0, chunk, f).0
}

/// A new buffer of `2 * half` values filled as [`pool_chunks_mut2`] fills its two buffers: the
/// first `half` values in pieces of `chunk`, the second likewise, piece `c` of each to
/// `f(c, first, second)`, each zeroed by its thread first (see [`pool_map_new`]).
pub fn pool_new_halves(half: usize, chunk: usize, f: impl Fn(usize, &mut [f32], &mut [f32]) + Sync) -> Vec<f32> {
    let chunk = chunk.max(1);
    let mut out: Vec<f32> = Vec::with_capacity(2 * half);
    let base = DisjointWrites::spare(&mut out, 2 * half);
    let fill = |range: std::ops::Range<usize>| {
        for c in range {
            let r = piece_range(c, chunk, half);
            // SAFETY: piece c of either half goes to this thread only (zeroed by it first).
            let (a, b) = unsafe { (base.zeroed(r.clone()), base.zeroed(half + r.start..half + r.end)) };
            f(c, a, b);
        }
    };
    match 2 * half <= INLINE_MAX_VALUES {
        true => fill(0..half.div_ceil(chunk)),
        false => candle_core::utils::barrier_pool().execute_chunked(half.div_ceil(chunk), fill),
    }
    // SAFETY: every piece of both halves was zeroed above.
    unsafe { out.set_len(2 * half) };
    out
}

/// `f(i)` for every `i` in `0..n` on candle's barrier pool, in order.
pub fn pool_map<R: Send + Sync>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let slots: Vec<std::sync::OnceLock<R>> = (0..n).map(|_| std::sync::OnceLock::new()).collect();
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        for i in range {
            let _ = slots[i].set(f(i));
        }
    });
    slots.into_iter().map(|s| s.into_inner().expect("every task ran")).collect()
}

/// Runs `task(scratch, i)` for every `i` in `0..n` on candle's barrier pool, the calling thread
/// included, each thread's range of tasks sharing one `scratch` from `init` (rayon's
/// `for_each_init`): training's attention runs on the pool its products run on.
pub fn on_pool<S>(n: usize, init: impl Fn() -> S + Sync, task: impl Fn(&mut S, usize) + Sync) {
    candle_core::utils::barrier_pool().execute_chunked(n, |range| {
        let mut scratch = init();
        for i in range {
            task(&mut scratch, i);
        }
    })
}

/// Values per piece of the pool's copies and sums: big enough that handing out a piece costs
/// nothing beside it, small enough that both threads get several.
const ELEMENTWISE_PIECE: usize = 1 << 16;

/// `dst += src` over the pool (one pass of memory traffic per thread instead of one thread's).
pub fn pool_add_into(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "pool_add_into: lengths differ");
    if dst.len() < ELEMENTWISE_PIECE {
        dst.iter_mut().zip(src).for_each(|(a, b)| *a += *b);
        return;
    }
    pool_chunks_mut(dst, ELEMENTWISE_PIECE, |c, piece| piece.iter_mut().zip(&src[c * ELEMENTWISE_PIECE..]).for_each(|(a, b)| *a += *b))
}

/// A copy of `src` made over the pool (into memory not zeroed first: every value is written).
pub fn pool_to_vec<T: Copy + Send + Sync>(src: &[T]) -> Vec<T> {
    use std::mem::MaybeUninit;
    if src.len() < ELEMENTWISE_PIECE {
        return src.to_vec();
    }
    let mut out: Vec<MaybeUninit<T>> = Vec::with_capacity(src.len());
    // SAFETY: MaybeUninit values need no initialisation; the capacity is src.len().
    unsafe { out.set_len(src.len()) };
    pool_chunks_mut(&mut out, ELEMENTWISE_PIECE, |c, piece| {
        for (o, x) in piece.iter_mut().zip(&src[c * ELEMENTWISE_PIECE..]) {
            o.write(*x);
        }
    });
    let mut out = std::mem::ManuallyDrop::new(out);
    // SAFETY: every element was written above; MaybeUninit<T> has T's layout.
    unsafe { Vec::from_raw_parts(out.as_mut_ptr().cast::<T>(), out.len(), out.capacity()) }
}

/// Runs `f` over ranges of `0..n` weight rows on candle's barrier pool, which its own ops use:
/// the calling thread works too, and the others spin briefly between decoding's ~200 products a
/// token instead of sleeping in the kernel (rayon's idle threads cost a quarter of a token's time
/// in `sched_yield` on 2 cores), and decoding runs on one pool, not two competing for the cores.
///
/// The threads take pieces from a shared cursor, each piece a share of what is left (guided
/// self-scheduling): large pieces first, then smaller ones, so the threads finish together. With
/// candle's equal pieces (an eighth of a thread's share each) one thread waited at the end of
/// every product for the other's last piece (docs/design.md, "Decoding's matrix-vector product").
pub fn for_weight_rows(n: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    if n == 0 {
        return;
    }
    let pool = candle_core::utils::barrier_pool();
    let threads = pool.n_workers() + 1;
    let cursor = std::sync::atomic::AtomicUsize::new(0);
    // One item per thread through candle's own entry (which runs a region started from inside
    // one inline): each thread then takes pieces until none is left.
    pool.execute_chunked(threads, |_| {
        while let Some(piece) = next_piece(&cursor, n, threads) {
            f(piece);
        }
    });
}

/// The next piece of `0..n` from `cursor`: `1 / (2 · threads)` of what is left, and no less than
/// `1 / (16 · threads)` of the whole (each take moves the cursor's cache line between cores, so
/// the pieces stay few).
fn next_piece(cursor: &std::sync::atomic::AtomicUsize, n: usize, threads: usize) -> Option<std::ops::Range<usize>> {
    use std::sync::atomic::Ordering::Relaxed;
    let smallest = n.div_ceil(16 * threads);
    let mut start = cursor.load(Relaxed);
    loop {
        if start >= n {
            return None;
        }
        let end = (start + (n - start).div_ceil(2 * threads).max(smallest)).min(n);
        match cursor.compare_exchange_weak(start, end, Relaxed, Relaxed) {
            Ok(_) => return Some(start..end),
            Err(now) => start = now,
        }
    }
}

/// [`for_weight_rows`] over the rows of several matrices (`rows[i]` each) as one region:
/// `f(i, range)` for the rows `range` of matrix `i`.
pub fn for_rows_of_many(rows: &[usize], f: impl Fn(usize, std::ops::Range<usize>) + Sync) {
    let starts: Vec<usize> = rows.iter().scan(0, |acc, r| Some(std::mem::replace(acc, *acc + r))).collect();
    for_weight_rows(rows.iter().sum(), |range| {
        // The part of `range` inside each matrix (a range may span two).
        for (i, (&start, &n)) in starts.iter().zip(rows).enumerate() {
            let (lo, hi) = (range.start.max(start), range.end.min(start + n));
            if lo < hi {
                f(i, lo - start..hi - start);
            }
        }
    });
}

/// Runs `f(i, chunk)` over the `chunk`-sized pieces of `out` on the same pool as
/// [`for_weight_rows`] (decoding's per-head attention).
pub fn for_chunks_mut(out: &mut [f32], chunk: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let n = out.len() / chunk;
    let base = DisjointWrites::new(out);
    for_weight_rows(n, |range| {
        for i in range {
            // SAFETY: piece i goes to this thread only.
            f(i, unsafe { base.piece(i * chunk..(i + 1) * chunk) });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cursor's pieces cover `0..n` once, in order, shrinking to no less than the smallest
    /// piece (bar the last), and a region over them calls `f` on each item exactly once.
    #[test]
    fn guided_pieces_cover_every_row_once() {
        for threads in [1, 2, 3, 16] {
            for n in [1, 2, 5, 9, 131, 576, 49152] {
                let cursor = std::sync::atomic::AtomicUsize::new(0);
                let pieces: Vec<_> = std::iter::from_fn(|| next_piece(&cursor, n, threads)).collect();
                assert_eq!(pieces.first().map(|p| p.start), Some(0));
                assert_eq!(pieces.last().map(|p| p.end), Some(n));
                assert!(pieces.windows(2).all(|p| p[0].end == p[1].start && p[0].len() >= p[1].len()), "{threads} {n}: {pieces:?}");
                let smallest = n.div_ceil(16 * threads);
                assert!(pieces[..pieces.len() - 1].iter().all(|p| p.len() >= smallest), "{threads} {n}: {pieces:?}");
                assert!(pieces.len() <= 4 * threads * 16, "{threads} {n}: {} pieces", pieces.len());
            }
        }
        let seen: Vec<std::sync::atomic::AtomicU32> = (0..1000).map(|_| std::sync::atomic::AtomicU32::new(0)).collect();
        for_weight_rows(seen.len(), |range| range.for_each(|i| _ = seen[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
        assert!(seen.iter().all(|c| c.load(std::sync::atomic::Ordering::Relaxed) == 1));
    }

    /// Every piece reaches `f` zeroed (what `vec![0.0; len]` gave), in pieces of the chunk with
    /// a shorter last one, and comes back filled; room is left after; the halves pair up. On the
    /// calling thread alone (small buffers) and over the pool (larger ones) alike.
    #[test]
    fn new_buffers_are_zeroed_piece_by_piece_then_filled() {
        for (len, chunk) in [(1000, 64), (INLINE_MAX_VALUES + 1000, 640)] {
            let (out, kept) = pool_map_new(len, 7, chunk, |c, piece| {
                let zeroed = piece.iter().all(|v| v.to_bits() == 0);
                piece.iter_mut().enumerate().filter(|(i, _)| i % 2 == 0).for_each(|(i, v)| *v = (c * chunk + i) as f32);
                (zeroed, piece.len())
            });
            assert!(kept.iter().all(|(zeroed, _)| *zeroed), "a piece came to f not zeroed");
            assert_eq!(kept.iter().map(|(_, n)| n).sum::<usize>(), len);
            assert_eq!(kept.last().unwrap().1, len % chunk);
            assert!(out.capacity() >= len + 7 && out.len() == len);
            assert!(out.iter().enumerate().all(|(i, v)| *v == if i % 2 == 0 { i as f32 } else { 0.0 }));
        }

        for half in [300, INLINE_MAX_VALUES] {
            let halves = pool_new_halves(half, 64, |c, a, b| {
                assert!(a.iter().chain(b.iter()).all(|v| v.to_bits() == 0) && a.len() == b.len());
                a.iter_mut().enumerate().for_each(|(i, v)| *v = (c * 64 + i) as f32);
                b.iter_mut().enumerate().for_each(|(i, v)| *v = -((c * 64 + i) as f32));
            });
            assert!((0..half).all(|i| halves[i] == i as f32 && halves[half + i] == -(i as f32)));
        }
    }
}
