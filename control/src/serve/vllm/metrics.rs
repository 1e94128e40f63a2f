//! An engine's Prometheus `/metrics` page read into what the controller's load reports carry.
//! vLLM's names (`vllm:num_requests_running`, ...) and SGLang's (`sglang:num_running_reqs`,
//! ...) are both known; a sample summed over label sets (one per model or rank).

/// What one scrape says about an engine.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scrape {
    pub running: u32,
    pub waiting: u32,
    /// Share of the KV cache in use, 0 to 1.
    pub kv_usage: f64,
    /// Prompt tokens looked up in and found in the prefix cache, since the engine started.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    /// From vLLM's `vllm:cache_config_info` labels.
    pub block_size: Option<u32>,
    pub gpu_blocks: Option<u64>,
    /// Whether the page had any of the names above (else it is not an engine's).
    pub known: bool,
}

/// Reads a page in Prometheus' text format; lines it does not know are skipped.
pub fn parse(page: &str) -> Scrape {
    let mut s = Scrape::default();
    for line in page.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (name, labels, value) = match split(line) {
            Some(parts) => parts,
            None => continue,
        };
        let known = true;
        match name {
            "vllm:num_requests_running" | "sglang:num_running_reqs" => s.running += value as u32,
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => s.waiting += value as u32,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                s.kv_usage = s.kv_usage.max(value)
            }
            "vllm:prefix_cache_queries_total" => s.prefix_queries += value as u64,
            "vllm:prefix_cache_hits_total" => s.prefix_hits += value as u64,
            "vllm:cache_config_info" => {
                s.block_size = label(labels, "block_size").and_then(|v| v.parse().ok());
                s.gpu_blocks = label(labels, "num_gpu_blocks").and_then(|v| v.parse().ok());
            }
            _ => continue,
        }
        s.known |= known;
    }
    s
}

/// The sum of series `name` over its label sets (0 where the page has none).
pub fn total(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(split)
        .filter(|(n, _, _)| *n == name)
        .map(|(_, _, v)| v)
        .sum()
}

/// `name{labels} value [timestamp]` → (name, labels, value).
fn split(line: &str) -> Option<(&str, &str, f64)> {
    let (head, rest) = match line.find('{') {
        Some(open) => {
            let close = line[open..].rfind('}')? + open;
            (&line[..open], (&line[open + 1..close], line[close + 1..].trim()))
        }
        None => {
            let (name, value) = line.split_once(char::is_whitespace)?;
            (name, ("", value.trim()))
        }
    };
    let (labels, rest) = rest;
    let value = rest.split_whitespace().next()?.parse().ok()?;
    Some((head.trim(), labels, value))
}

/// The value of label `key` in `a="x",b="y"` (values without escaped quotes).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    while let Some(eq) = rest.find("=\"") {
        let name = rest[..eq].trim_start_matches([',', ' ']);
        let value_start = eq + 2;
        let end = rest[value_start..].find('"')? + value_start;
        if name == key {
            return Some(&rest[value_start..end]);
        }
        rest = &rest[end + 1..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as vLLM 0.32 prints them.
    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 640.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 320.0
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="1024"} 1.0
python_gc_objects_collected_total{generation="0"} 1234.0
"#;

    #[test]
    fn a_series_is_summed_over_its_label_sets() {
        let page =
            "# HELP x\nvllm:t_sum{engine=\"0\"} 1.5\nvllm:t_sum{engine=\"1\"} 2 1700000000\nvllm:t_sum_other 9\n";
        assert_eq!(total(page, "vllm:t_sum"), 3.5);
        assert_eq!(total(page, "vllm:none"), 0.0);
    }

    #[test]
    fn vllm_page() {
        let s = parse(VLLM);
        assert_eq!(
            s,
            Scrape {
                running: 2,
                waiting: 3,
                kv_usage: 0.25,
                prefix_queries: 640,
                prefix_hits: 320,
                block_size: Some(32),
                gpu_blocks: Some(1024),
                known: true
            }
        );
    }

    #[test]
    fn sglang_page_and_strangers() {
        let s = parse("sglang:num_running_reqs{model_name=\"m\"} 4\nsglang:num_queue_reqs{model_name=\"m\"} 1\nsglang:token_usage 0.5\n");
        assert_eq!((s.running, s.waiting, s.kv_usage, s.known), (4, 1, 0.5, true));
        assert!(!parse("<html>not metrics</html>\nup 1\n").known);
    }
}
