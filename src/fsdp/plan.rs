//! Which parameters are gathered together (units, from a wrap policy), how each is cut into
//! per-rank chunks, and in which stages each unit is needed.

use std::collections::HashMap;

use anyhow::{bail, Result};
use models::tensors::TensorSpec;
use models::StagedModel;

/// How units are formed, as in PyTorch FSDP's auto-wrap policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrapPolicy {
    /// One unit per transformer block, plus a root unit for everything else.
    TransformerBased,
    /// Consecutive blocks grouped until a unit holds at least `min_num_params` parameters.
    SizeBased { min_num_params: usize },
    /// One unit holding every parameter.
    NoWrap,
}

impl std::str::FromStr for WrapPolicy {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "transformer_based_wrap" | "TRANSFORMER_BASED_WRAP" => Self::TransformerBased,
            "size_based_wrap" | "SIZE_BASED_WRAP" => Self::SizeBased { min_num_params: 100_000_000 },
            "no_wrap" | "NO_WRAP" => Self::NoWrap,
            other => bail!("--wrap-policy {other:?}: use transformer_based_wrap, size_based_wrap or no_wrap"),
        })
    }
}

/// How parameters are spread over ranks (PyTorch's ShardingStrategy names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardingStrategy {
    /// Shard everything; free gathered weights after each unit's forward.
    FullShard,
    /// Shard everything; keep gathered weights from forward until backward.
    ShardGradOp,
    /// Replicate (no sharding); all-reduce gradients.
    NoShard,
    /// Full sharding inside groups of `--shard-group-size` ranks, replication across groups.
    HybridShard,
}

impl std::str::FromStr for ShardingStrategy {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        let upper = s.to_ascii_uppercase();
        match Self::ALL.into_iter().find(|x| x.as_str() == upper) {
            Some(x) => Ok(x),
            None => bail!("--sharding-strategy {s:?}: use FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD"),
        }
    }
}

impl std::fmt::Display for ShardingStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl ShardingStrategy {
    pub const ALL: [ShardingStrategy; 4] = [Self::FullShard, Self::ShardGradOp, Self::NoShard, Self::HybridShard];

    /// PyTorch FSDP's name (`ShardingStrategy.FULL_SHARD`, ...), what flags and files say.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FullShard => "FULL_SHARD",
            Self::ShardGradOp => "SHARD_GRAD_OP",
            Self::NoShard => "NO_SHARD",
            Self::HybridShard => "HYBRID_SHARD",
        }
    }

    pub fn reshard_after_forward(self) -> bool {
        matches!(self, Self::FullShard | Self::HybridShard)
    }

    /// Ranks each parameter is sharded over, for `world` ranks (and `--shard-group-size` for
    /// HYBRID_SHARD, which must divide `world`).
    pub fn shard_count(self, world: usize, group: Option<usize>) -> Result<usize> {
        Ok(match (self, group) {
            (Self::FullShard | Self::ShardGradOp, None) => world,
            (Self::NoShard, None) => 1,
            (Self::HybridShard, None) => bail!("HYBRID_SHARD needs --shard-group-size"),
            (Self::HybridShard, Some(g)) if g == 0 || !world.is_multiple_of(g) => {
                bail!("--shard-group-size {g} must divide --world-size {world}")
            }
            (Self::HybridShard, Some(g)) => g,
            (_, Some(_)) => bail!("--shard-group-size applies to HYBRID_SHARD only"),
        })
    }
}

/// One parameter's place in its unit: dim 0 padded to a multiple of the shard count, cut into
/// equal row chunks.
#[derive(Debug, Clone)]
pub struct ParamLayout {
    pub spec: TensorSpec,
    pub rows: usize,
    pub row_len: usize,
    pub chunk_rows: usize,
    /// Offset of this parameter's chunk inside the unit's per-rank buffer.
    pub offset: usize,
    /// Trained (has gradient and optimizer state) or frozen (a LoRA base).
    pub trainable: bool,
    /// Offset of this parameter's chunk inside the unit's per-rank gradient buffer, which holds
    /// the trainable parameters only.
    pub grad_offset: usize,
}

impl ParamLayout {
    pub fn numel(&self) -> usize {
        self.rows * self.row_len
    }
    pub fn chunk_len(&self) -> usize {
        self.chunk_rows * self.row_len
    }

    /// Rank `k`'s chunk of the full (unpadded) values, padding rows zero.
    pub fn chunk_of(&self, full: &[f32], k: usize) -> Vec<f32> {
        let start = (k * self.chunk_len()).min(full.len());
        let end = ((k + 1) * self.chunk_len()).min(full.len());
        let mut c = full[start..end].to_vec();
        c.resize(self.chunk_len(), 0.0);
        c
    }
}

/// A group of parameters gathered with one collective.
#[derive(Debug, Clone)]
pub struct UnitPlan {
    pub name: String,
    pub params: Vec<ParamLayout>,
    /// Length of one rank's buffer (sum of the chunk lengths).
    pub chunk_len: usize,
    /// Length of one rank's gradient buffer (chunks of the trainable parameters).
    pub grad_chunk_len: usize,
    /// First and last stage that read this unit.
    pub first_stage: usize,
    pub last_stage: usize,
    /// A unit of the parameters outside the transformer blocks (embeddings, final norm, head).
    pub is_root: bool,
}

impl UnitPlan {
    pub fn numel(&self) -> usize {
        self.params.iter().map(ParamLayout::numel).sum()
    }
}

/// Lays out a unit's parameters; returns them with the per-rank buffer and gradient lengths.
fn layout(specs: Vec<TensorSpec>, shards: usize, trainable: &dyn Fn(&str) -> bool) -> (Vec<ParamLayout>, usize, usize) {
    let (mut offset, mut grad_offset) = (0, 0);
    let params = specs
        .into_iter()
        .map(|spec| {
            let rows = spec.shape[0];
            let row_len: usize = spec.shape[1..].iter().product();
            let chunk_rows = rows.div_ceil(shards);
            let trainable = trainable(&spec.name);
            let p = ParamLayout { spec, rows, row_len, chunk_rows, offset, trainable, grad_offset };
            offset += p.chunk_len();
            if trainable {
                grad_offset += p.chunk_len();
            }
            p
        })
        .collect();
    (params, offset, grad_offset)
}

/// Splits the model's parameters into units and cuts each for `shards` ranks.
pub fn plan_units(model: &dyn StagedModel, policy: WrapPolicy, shards: usize) -> Result<Vec<UnitPlan>> {
    let params = model.parameters();
    let blocks = model.block_prefixes();
    let numel = |t: &TensorSpec| t.shape.iter().product::<usize>();
    let in_block = |t: &TensorSpec, b: &str| t.name.starts_with(b);
    let mut groups: Vec<(String, Vec<TensorSpec>)> = vec![];
    match policy {
        WrapPolicy::NoWrap => {}
        WrapPolicy::TransformerBased => {
            if blocks.is_empty() {
                bail!("transformer_based_wrap needs transformer blocks, and this model has none; use no_wrap");
            }
            for b in &blocks {
                let ps: Vec<TensorSpec> = params.iter().filter(|t| in_block(t, b)).cloned().collect();
                groups.push((b.trim_end_matches('.').to_string(), ps));
            }
        }
        WrapPolicy::SizeBased { min_num_params } => {
            if min_num_params == 0 {
                bail!("size_based_wrap needs --min-num-params > 0");
            }
            let mut current: Vec<TensorSpec> = vec![];
            let mut first_block = 0;
            for (i, b) in blocks.iter().enumerate() {
                if current.is_empty() {
                    first_block = i;
                }
                current.extend(params.iter().filter(|t| in_block(t, b)).cloned());
                if current.iter().map(numel).sum::<usize>() >= min_num_params {
                    groups.push((format!("blocks.{first_block}-{i}"), std::mem::take(&mut current)));
                }
            }
            // A tail smaller than the threshold stays in the root unit, as PyTorch leaves modules
            // below the threshold to their parent.
            if groups.is_empty() {
                let total: usize = params.iter().map(numel).sum();
                bail!(
                    "size_based_wrap with min_num_params {min_num_params} makes no unit: no run of the model's {} \
                     blocks reaches it ({total} parameters in all); lower --min-num-params or use no_wrap",
                    blocks.len()
                );
            }
        }
    }
    let grouped: std::collections::HashSet<String> = groups.iter().flat_map(|(_, ps)| ps.iter().map(|t| t.name.clone())).collect();
    let root: Vec<TensorSpec> = params.iter().filter(|t| !grouped.contains(&t.name)).cloned().collect();

    // Stage range of each parameter.
    let mut stages_of: HashMap<String, (usize, usize)> = HashMap::new();
    for s in 0..model.num_stages() {
        for n in model.stage_parameters(s) {
            let e = stages_of.entry(n).or_insert((s, s));
            e.0 = e.0.min(s);
            e.1 = e.1.max(s);
        }
    }
    let mut units = vec![];
    let mut push = |name: String, specs: Vec<TensorSpec>, is_root: bool| -> Result<()> {
        if specs.is_empty() {
            return Ok(());
        }
        let mut first = usize::MAX;
        let mut last = 0;
        for t in &specs {
            let Some(&(a, b)) = stages_of.get(&t.name) else { bail!("parameter {} is read by no stage", t.name) };
            first = first.min(a);
            last = last.max(b);
        }
        let (params, chunk_len, grad_chunk_len) = layout(specs, shards, &|n| model.trainable(n));
        units.push(UnitPlan { name, params, chunk_len, grad_chunk_len, first_stage: first, last_stage: last, is_root });
        Ok(())
    };
    // Blocks wrapped one per unit: the rest is cut as torchtitan does. Under the other policies
    // it stays one root unit, as PyTorch leaves unwrapped modules to the root.
    let roots = match policy {
        WrapPolicy::TransformerBased => split_root(root, &stages_of),
        _ => vec![("root".to_string(), root)],
    };
    for (name, ps) in roots {
        push(name, ps, true)?;
    }
    for (name, ps) in groups {
        push(name, ps, false)?;
    }
    Ok(units)
}

/// Cuts the parameters outside the blocks into units as torchtitan shards them: the embedding
/// alone, the final norm and head together, so that each is gathered only around the stages
/// that read it. Parameters whose stages overlap share a unit, so a tied embedding (read by the
/// first stage and, as the head, by the last) makes one unit with the final norm. A parameter
/// no stage reads goes to the first group (and `push` reports it).
fn split_root(root: Vec<TensorSpec>, stages_of: &HashMap<String, (usize, usize)>) -> Vec<(String, Vec<TensorSpec>)> {
    // (stage range, parameters), merged while ranges overlap; ranges sorted by first stage.
    let mut groups: Vec<((usize, usize), Vec<TensorSpec>)> = vec![];
    let mut sorted: Vec<(Option<(usize, usize)>, TensorSpec)> = root.into_iter().map(|t| (stages_of.get(&t.name).copied(), t)).collect();
    sorted.sort_by_key(|(r, _)| r.map(|r| r.0).unwrap_or(0));
    for (range, t) in sorted {
        let Some((a, b)) = range else {
            match groups.first_mut() {
                Some(g) => g.1.push(t),
                None => groups.push(((0, 0), vec![t])),
            }
            continue;
        };
        match groups.iter_mut().find(|((lo, hi), _)| a <= *hi && *lo <= b) {
            Some(((lo, hi), ps)) => {
                (*lo, *hi) = ((*lo).min(a), (*hi).max(b));
                ps.push(t);
            }
            None => groups.push(((a, b), vec![t])),
        }
    }
    let n = groups.len();
    groups
        .into_iter()
        .enumerate()
        .map(|(i, (_, ps))| {
            let name = match (n, i) {
                (1, _) => "root".to_string(),
                (_, 0) => "embeddings".to_string(),
                (_, i) if i == n - 1 => "head".to_string(),
                (_, i) => format!("root.{i}"),
            };
            (name, ps)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> models::ModelConfig {
        models::ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,"intermediate_size":12,
                "num_hidden_layers":3,"num_attention_heads":2,"num_key_value_heads":1,"tie_word_embeddings":true}"#,
        )
        .unwrap()
    }

    #[test]
    fn transformer_wrap_gives_one_unit_per_block_plus_root() {
        let m = models::LlamaStages::new(&cfg(), None);
        let units = plan_units(&m, WrapPolicy::TransformerBased, 4).unwrap();
        assert_eq!(units.len(), 4);
        assert!(units[0].is_root && units[0].first_stage == 0 && units[0].last_stage == 4);
        // Tied: the embedding is the head; it appears once, in the root.
        assert_eq!(
            units[0].params.iter().map(|p| p.spec.name.as_str()).collect::<Vec<_>>(),
            ["model.embed_tokens.weight", "model.norm.weight"]
        );
        assert_eq!((units[2].first_stage, units[2].last_stage), (2, 2));
        let total: usize = units.iter().map(UnitPlan::numel).sum();
        assert_eq!(total, models::expected_tensors(&cfg()).iter().map(|t| t.shape.iter().product::<usize>()).sum::<usize>());
        // vocab 10 rows on 4 ranks: padded to 12, 3 rows each.
        assert_eq!(units[0].params[0].chunk_rows, 3);
    }

    #[test]
    fn an_untied_model_gets_an_embedding_unit_and_a_head_unit() {
        let mut c = cfg();
        c.tie_word_embeddings = false;
        let m = models::LlamaStages::new(&c, None);
        let units = plan_units(&m, WrapPolicy::TransformerBased, 2).unwrap();
        let names = |u: &UnitPlan| u.params.iter().map(|p| p.spec.name.clone()).collect::<Vec<_>>();
        assert_eq!(
            units.iter().map(|u| u.name.as_str()).collect::<Vec<_>>(),
            ["embeddings", "head", "model.layers.0", "model.layers.1", "model.layers.2"]
        );
        assert_eq!(names(&units[0]), ["model.embed_tokens.weight"]);
        assert_eq!((units[0].first_stage, units[0].last_stage), (0, 0));
        assert_eq!(names(&units[1]), ["model.norm.weight", "lm_head.weight"]);
        assert_eq!((units[1].first_stage, units[1].last_stage), (4, 4));
        // no_wrap keeps everything in one unit.
        assert_eq!(plan_units(&m, WrapPolicy::NoWrap, 2).unwrap().len(), 1);
    }

    #[test]
    fn size_wrap_groups_blocks_and_refuses_impossible_thresholds() {
        let m = models::LlamaStages::new(&cfg(), None);
        let per_block: usize = models::tensors::layer_tensors(&cfg(), 0).iter().map(|t| t.shape.iter().product::<usize>()).sum();
        let units = plan_units(&m, WrapPolicy::SizeBased { min_num_params: 2 * per_block }, 2).unwrap();
        assert_eq!(units.iter().map(|u| u.name.as_str()).collect::<Vec<_>>(), ["root", "blocks.0-1"]);
        assert!(units[0].params.iter().any(|p| p.spec.name.starts_with("model.layers.2.")));
        let err = plan_units(&m, WrapPolicy::SizeBased { min_num_params: 100 * per_block }, 2).unwrap_err();
        assert!(err.to_string().contains("makes no unit"), "{err}");
        assert_eq!(plan_units(&m, WrapPolicy::NoWrap, 2).unwrap().len(), 1);
    }

    #[test]
    fn chunks_pad_with_zero_rows() {
        let (ps, len, grad_len) = layout(vec![TensorSpec { name: "w".into(), shape: vec![3, 2] }], 2, &|_| true);
        assert_eq!((len, grad_len), (4, 4));
        let full = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(ps[0].chunk_of(&full, 0), vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(ps[0].chunk_of(&full, 1), vec![5.0, 6.0, 0.0, 0.0]);
    }
}
