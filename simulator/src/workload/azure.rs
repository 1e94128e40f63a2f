//! Azure LLM inference traces (Azure/AzurePublicDataset, the Splitwise traces).
//!
//! ```text
//! TIMESTAMP,ContextTokens,GeneratedTokens
//! 2023-11-16 18:15:46.6805900,374,44
//! ```
//!
//! `TIMESTAMP` is a wall-clock time with up to 7 fractional digits (we accept up to 9 and keep
//! microseconds, truncating). It is parsed by hand, the date through the days-from-civil
//! formula, and arrivals are timed from the first row, which arrives at time 0.
//!
//! The trace carries no prefix information, so every request gets its own chain of block
//! hashes: block j of request i hashes `mix64(base_i + j)` with `base_i` drawn from the seed
//! and i. Nothing is shared, so any cache hit in a run on this trace is a bug.

use super::lines::Lines;
use super::{scaled_time, Arrival, ReadArrival, WorkloadError, WorkloadOptions};
use engine::ids::mix64;
use engine::BlockHash;
use std::path::{Path, PathBuf};

const HEADER: [&str; 3] = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"];

/// Separates the hash salt of this reader from other users of the same seed.
const SALT_TAG: u64 = 0x617a_7572_655f_6b76;

pub(super) struct AzureTrace {
    path: PathBuf,
    lines: Lines,
    block_size: u32,
    rate_scale: f64,
    /// Derived from the seed; makes each run's unique hashes its own.
    salt: u64,
    /// The first row's time in µs since 1970, the origin of arrival times.
    first_us: Option<i64>,
    /// The previous row's time and text, for the ordering check and its message.
    prev_us: i64,
    prev_text: String,
    /// 0-based index of the next request.
    index: u64,
}

impl AzureTrace {
    /// Opens the file and checks its header (the first non-blank line).
    pub(super) fn open(path: &Path, opts: &WorkloadOptions) -> Result<AzureTrace, WorkloadError> {
        let mut lines = Lines::open(path)?;
        loop {
            let Some((line, text)) = lines.next_line()? else {
                return Err(lines.error(1, format!("empty file, expected the header `{}`", HEADER.join(","))));
            };
            if text.trim().is_empty() {
                continue;
            }
            if !text.split(',').map(str::trim).eq(HEADER) {
                let reason = format!("expected the header `{}`, found `{}`", HEADER.join(","), text.trim());
                return Err(lines.error(line, reason));
            }
            break;
        }
        Ok(AzureTrace {
            path: path.to_path_buf(),
            lines,
            block_size: opts.block_size.max(1),
            rate_scale: opts.rate_scale,
            salt: mix64(opts.seed ^ SALT_TAG),
            first_us: None,
            prev_us: i64::MIN,
            prev_text: String::new(),
            index: 0,
        })
    }

    fn read(&mut self, mut buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
        let (line, text) = loop {
            let Some((line, text)) = self.lines.next_line()? else { return Ok(None) };
            if !text.trim().is_empty() {
                break (line, text);
            }
        };
        // `text` borrows `self.lines`, so errors are built from our own copy of the path.
        let path = &self.path;
        let error = |reason: String| WorkloadError::Parse { path: path.clone(), line, reason };
        let mut cols = text.split(',');
        let (Some(ts), Some(context), Some(generated), None) = (cols.next(), cols.next(), cols.next(), cols.next())
        else {
            return Err(error(format!("expected 3 columns ({}), found {}", HEADER.join(","), text.split(',').count())));
        };
        let ts = ts.trim();
        let us = parse_timestamp(ts).map_err(error)?;
        if us < self.prev_us {
            return Err(error(format!("timestamp goes backwards ({ts} after {})", self.prev_text)));
        }
        let context = parse_tokens("ContextTokens", context).map_err(error)?;
        let generated = parse_tokens("GeneratedTokens", generated).map_err(error)?;
        if context == 0 {
            return Err(error("ContextTokens must be at least 1".into()));
        }
        self.prev_us = us;
        self.prev_text.clear();
        self.prev_text.push_str(ts);
        let first = *self.first_us.get_or_insert(us);

        let blocks = context / self.block_size;
        let base = mix64(self.salt ^ self.index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        buf.clear();
        buf.reserve(blocks as usize);
        let mut hash = BlockHash::ROOT;
        for j in 0..u64::from(blocks) {
            hash = hash.chain(mix64(base.wrapping_add(j)));
            buf.push(hash);
        }
        self.index += 1;

        // Non-negative: `us >= prev_us >= first`.
        let offset_us = u64::try_from(us - first).unwrap_or(0);
        Ok(Some(Arrival {
            at: scaled_time(offset_us, self.rate_scale),
            prompt_tokens: context,
            output_tokens: generated,
            block_hashes: buf,
            service: Default::default(),
        }))
    }
}

impl ReadArrival for AzureTrace {
    fn read_arrival(&mut self, buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
        self.read(buf)
    }
}

fn parse_tokens(column: &str, text: &str) -> Result<u32, String> {
    let text = text.trim();
    text.parse::<u32>()
        .map_err(|_| format!("{column} `{text}` is not a token count (an integer from 0 to {})", u32::MAX))
}

/// Parses `YYYY-MM-DD HH:MM:SS[.fraction]` (a `T` may separate date and time) into
/// microseconds since 1970-01-01 00:00:00, truncating below the microsecond. The time zone
/// does not matter: only differences are used.
fn parse_timestamp(text: &str) -> Result<i64, String> {
    let bad = |why: &str| format!("bad timestamp `{text}`: {why}");
    let b = text.as_bytes();
    let shape_ok = b.len() >= 19
        && b[4] == b'-'
        && b[7] == b'-'
        && (b[10] == b' ' || b[10] == b'T')
        && b[13] == b':'
        && b[16] == b':';
    if !shape_ok {
        return Err(bad("expected `YYYY-MM-DD HH:MM:SS[.fraction]`"));
    }
    let number = |from: usize, to: usize| -> Result<i64, String> {
        b[from..to].iter().try_fold(0i64, |n, &c| {
            if c.is_ascii_digit() {
                Ok(n * 10 + i64::from(c - b'0'))
            } else {
                Err(bad("expected `YYYY-MM-DD HH:MM:SS[.fraction]`"))
            }
        })
    };
    let (year, month, day) = (number(0, 4)?, number(5, 7)?, number(8, 10)?);
    let (hour, minute, second) = (number(11, 13)?, number(14, 16)?, number(17, 19)?);
    let micros = match &b[19..] {
        [] => 0,
        [b'.', frac @ ..] if (1..=9).contains(&frac.len()) && frac.iter().all(u8::is_ascii_digit) => {
            frac.iter().chain(std::iter::repeat(&b'0')).take(6).fold(0i64, |n, &c| n * 10 + i64::from(c - b'0'))
        }
        _ => return Err(bad("expected 1 to 9 fractional digits after the seconds")),
    };
    if !(1..=12).contains(&month) {
        return Err(bad("month out of range"));
    }
    if day < 1 || day > days_in_month(year, month) {
        return Err(bad("day out of range"));
    }
    if hour > 23 || minute > 59 || second > 59 {
        return Err(bad("time of day out of range"));
    }
    let days = days_from_civil(year, month, day);
    Ok((((days * 24 + hour) * 60 + minute) * 60 + second) * 1_000_000 + micros)
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's `days_from_civil`):
/// counting years from March puts the leap day last, so each 400-year era has a fixed
/// 146,097 days and a day of the year follows from the month by `(153 m' + 2) / 5`.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let year_of_era = y - era * 400;
    let month_from_march = (month + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::test_util::{drain, first_error, TempTrace, AZURE_CONVERSATION};
    use crate::workload::{limit, open_trace, TraceFormat};

    const HEAD: &str = "TIMESTAMP,ContextTokens,GeneratedTokens\n";

    fn opts(seed: u64) -> WorkloadOptions {
        WorkloadOptions { seed, ..WorkloadOptions::default() }
    }

    fn error_of(contents: &str) -> String {
        let trace = TempTrace::new("bad.csv", contents);
        let err = first_error(open_trace(trace.path(), TraceFormat::Azure, &opts(0)));
        err.replace(&trace.path().display().to_string(), "PATH")
    }

    #[test]
    fn days_from_civil_matches_known_dates() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(1969, 12, 31), -1);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(2023, 11, 16), 19_677);
        assert_eq!(days_from_civil(2024, 3, 1) - days_from_civil(2024, 2, 28), 2);
    }

    #[test]
    fn azure_timestamps_parse_to_microseconds() {
        let day = 19_677 * 86_400_000_000i64;
        let time = ((18 * 60 + 15) * 60 + 46) * 1_000_000i64;
        assert_eq!(parse_timestamp("2023-11-16 18:15:46.6805900"), Ok(day + time + 680_590));
        assert_eq!(parse_timestamp("2023-11-16T18:15:46.6805909"), Ok(day + time + 680_590));
        assert_eq!(parse_timestamp("2023-11-16 18:15:46.5"), Ok(day + time + 500_000));
        assert_eq!(parse_timestamp("2023-11-16 18:15:46"), Ok(day + time));
        for bad in [
            "2023-11-16",
            "2023-13-16 18:15:46",
            "2023-02-29 18:15:46",
            "2023-11-16 24:00:00",
            "2023-11-16 18:15:46.",
            "2023-11-16 18:15:46.1234567890",
            "2023-11-16 18:15:4x",
            "2023-11-16 18:15:46Z",
            "2023-1é-16 18:15:46",
        ] {
            assert!(parse_timestamp(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_timestamp("2024-02-29 00:00:00").map(|us| us % 86_400_000_000), Ok(0));
    }

    #[test]
    fn first_hundred_azure_rows_arrive_in_order_from_time_zero() {
        let w = open_trace(AZURE_CONVERSATION.as_ref(), TraceFormat::Azure, &opts(1));
        let arrivals = drain(w.map(|w| limit(w, 100)));
        assert_eq!(arrivals.len(), 100);
        assert!(arrivals.windows(2).all(|p| p[0].at <= p[1].at));
        let a = &arrivals[..2];
        assert_eq!((a[0].at.0, a[0].prompt_tokens, a[0].output_tokens), (0, 374, 44));
        // 18:15:50.9951690 - 18:15:46.6805900.
        assert_eq!((a[1].at.0, a[1].prompt_tokens, a[1].output_tokens), (4_314_579, 396, 109));
        assert_eq!(a[0].block_hashes.len(), 374 / 16);
    }

    #[test]
    fn whole_azure_trace_streams_one_arrival_per_row() {
        let arrivals = drain(open_trace(AZURE_CONVERSATION.as_ref(), TraceFormat::Azure, &opts(1)));
        assert_eq!(arrivals.len(), 19_366);
        // 58.4 minutes.
        let last = arrivals.last().map(|a| a.at.0).unwrap_or(0);
        assert!((3_480_000_000..3_540_000_000).contains(&last), "{last}");
    }

    #[test]
    fn azure_requests_get_unique_hashes_that_depend_only_on_the_seed() {
        let text = format!("{HEAD}2023-11-16 18:15:46.0,64,1\n2023-11-16 18:15:46.0,64,1\n");
        let trace = TempTrace::new("unique.csv", &text);
        let read = |seed| drain(open_trace(trace.path(), TraceFormat::Azure, &opts(seed)));
        let (a, b, c) = (read(1), read(1), read(2));
        assert_eq!(a, b);
        assert_eq!(a[0].block_hashes.len(), 4);
        assert!(a[0].block_hashes.iter().all(|h| !a[1].block_hashes.contains(h)));
        assert!(a[0].block_hashes.iter().all(|h| !c[0].block_hashes.contains(h)));
    }

    #[test]
    fn malformed_azure_rows_name_the_file_line_and_reason() {
        let ok = "2023-11-16 18:15:46.6805900,374,44\n";
        let check = |bad: &str, expected: &str| {
            assert_eq!(error_of(&format!("{HEAD}{ok}{bad}\n")), format!("parsing trace PATH: line 3: {expected}"));
        };
        check("2023-11-16 18:15:47.0,374", "expected 3 columns (TIMESTAMP,ContextTokens,GeneratedTokens), found 2");
        check("2023-11-16 18:15:47.0,374,1,2", "expected 3 columns (TIMESTAMP,ContextTokens,GeneratedTokens), found 4");
        check(
            "2023-11-16 18:15:xx.0,374,44",
            "bad timestamp `2023-11-16 18:15:xx.0`: expected `YYYY-MM-DD HH:MM:SS[.fraction]`",
        );
        check("2023-11-31 18:15:47.0,374,44", "bad timestamp `2023-11-31 18:15:47.0`: day out of range");
        check(
            "2023-11-16 18:15:45.0,374,44",
            "timestamp goes backwards (2023-11-16 18:15:45.0 after 2023-11-16 18:15:46.6805900)",
        );
        check(
            "2023-11-16 18:15:47.0,many,44",
            "ContextTokens `many` is not a token count (an integer from 0 to 4294967295)",
        );
        check("2023-11-16 18:15:47.0,0,44", "ContextTokens must be at least 1");
        check(
            "2023-11-16 18:15:47.0,10,-1",
            "GeneratedTokens `-1` is not a token count (an integer from 0 to 4294967295)",
        );
    }

    #[test]
    fn a_bad_or_missing_azure_header_is_an_error_when_opening() {
        assert_eq!(
            error_of("time,in,out\n2023-11-16 18:15:46.6805900,374,44\n"),
            "parsing trace PATH: line 1: expected the header `TIMESTAMP,ContextTokens,GeneratedTokens`, found `time,in,out`"
        );
        assert_eq!(
            error_of(""),
            "parsing trace PATH: line 1: empty file, expected the header `TIMESTAMP,ContextTokens,GeneratedTokens`"
        );
    }

    #[test]
    fn zero_generated_tokens_and_crlf_endings_are_accepted() {
        let trace =
            TempTrace::new("crlf.csv", "TIMESTAMP, ContextTokens ,GeneratedTokens\r\n2023-11-16 18:15:46.0,5,0\r\n");
        let arrivals = drain(open_trace(trace.path(), TraceFormat::Azure, &opts(0)));
        assert_eq!(arrivals.len(), 1);
        assert_eq!((arrivals[0].prompt_tokens, arrivals[0].output_tokens), (5, 0));
        assert!(arrivals[0].block_hashes.is_empty());
    }
}
