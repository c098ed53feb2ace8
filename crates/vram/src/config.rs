//! The governor's settings: per-card floor, arming margin, reclaim overshoot
//! and budget, plus the sampler and arena timings.
//!
//! The cli parses `--floor-mib N[,N,...]` and `--card-budget-mib N[,N,...]`
//! once into a [`GovernorConfig`]; nothing in this crate reads flags or the
//! environment.

use corridor_units::{Bytes, CardId};
use std::time::Duration;

/// The law floor every card defaults to.
pub const DEFAULT_FLOOR: Bytes = Bytes::mib(1024);
/// How far above the target the guard reclaims, so the next allocations do
/// not each pay for a spill.
pub const DEFAULT_DELTA: Bytes = Bytes::mib(256);
/// How often the sampler reads every card's free memory.
pub const DEFAULT_SAMPLE_INTERVAL: Duration = Duration::from_millis(100);
/// How long KV waits after a release before it grows back, and how long a
/// chunk must sit idle before an on-demand arena trims it.
pub const DEFAULT_KV_HOLD: Duration = Duration::from_secs(5);
/// How often serving marks are written.
pub const DEFAULT_SERVING_MARK_INTERVAL: Duration = Duration::from_secs(30);

/// Why a configuration was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{flag}: '{value}' is not a list of MiB counts like 1024 or 1024,2048")]
    BadList { flag: &'static str, value: String },
    #[error("{flag}: {given} values for {cards} cards (give one for all cards or one per card)")]
    WrongCount { flag: &'static str, given: usize, cards: usize },
    #[error("{card}: arming floor {arming} is below the law floor {floor}")]
    InvertedFloors { card: CardId, arming: Bytes, floor: Bytes },
    #[error("{card}: budget {budget} must be greater than zero")]
    ZeroBudget { card: CardId, budget: Bytes },
    #[error("card at position {position} calls itself {card}; cards must be numbered in order from card0")]
    CardOrder { position: usize, card: CardId },
    #[error("{cards} cards but settings for {settings}")]
    CardCount { cards: usize, settings: usize },
}

/// One card's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CardSettings {
    /// The law: the driver's free memory must never fall under this.
    pub floor: Bytes,
    /// Extra headroom above the law where the guard already arms. The
    /// arming floor (`floor + arm_margin`) decides when to reclaim; only the
    /// law floor decides a refusal, so a reserve that lands between the two
    /// is granted (judging refusals by the arming floor wedged the system
    /// this project learns from).
    pub arm_margin: Bytes,
    /// Reclaim overshoot above the arming floor.
    pub delta: Bytes,
    /// Upper bound on what corridor itself may hold on the card (our books).
    pub budget: Option<Bytes>,
}

impl Default for CardSettings {
    fn default() -> Self {
        CardSettings { floor: DEFAULT_FLOOR, arm_margin: Bytes::ZERO, delta: DEFAULT_DELTA, budget: None }
    }
}

impl CardSettings {
    /// The free-memory level under which the guard starts reclaiming.
    pub fn arming_floor(&self) -> Bytes {
        self.floor + self.arm_margin
    }
}

/// Everything the governor needs, frozen at boot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GovernorConfig {
    /// One entry per card, indexed by `CardId`.
    pub cards: Vec<CardSettings>,
    pub sample_interval: Duration,
    pub kv_hold: Duration,
    pub serving_mark_interval: Duration,
}

impl GovernorConfig {
    /// The same settings on `cards` cards, default timings.
    pub fn uniform(cards: usize, settings: CardSettings) -> GovernorConfig {
        GovernorConfig {
            cards: vec![settings; cards],
            sample_interval: DEFAULT_SAMPLE_INTERVAL,
            kv_hold: DEFAULT_KV_HOLD,
            serving_mark_interval: DEFAULT_SERVING_MARK_INTERVAL,
        }
    }

    /// Build from the flag texts: `floor_mib` and `budget_mib` are
    /// `N[,N,...]` (one value for every card, or one per card); `None`
    /// means the flag was not given.
    pub fn from_flags(
        cards: usize,
        floor_mib: Option<&str>,
        budget_mib: Option<&str>,
    ) -> Result<GovernorConfig, ConfigError> {
        let mut config = GovernorConfig::uniform(cards, CardSettings::default());
        if let Some(text) = floor_mib {
            let floors = spread_list("--floor-mib", &parse_mib_list("--floor-mib", text)?, cards)?;
            for (s, f) in config.cards.iter_mut().zip(floors) {
                s.floor = Bytes::mib(f);
            }
        }
        if let Some(text) = budget_mib {
            let budgets =
                spread_list("--card-budget-mib", &parse_mib_list("--card-budget-mib", text)?, cards)?;
            for (s, b) in config.cards.iter_mut().zip(budgets) {
                s.budget = Some(Bytes::mib(b));
            }
        }
        config.validate(cards)?;
        Ok(config)
    }

    /// Check the settings against a fleet of `cards` cards.
    pub fn validate(&self, cards: usize) -> Result<(), ConfigError> {
        if self.cards.len() != cards {
            return Err(ConfigError::CardCount { cards, settings: self.cards.len() });
        }
        for (i, s) in self.cards.iter().enumerate() {
            let card = CardId(i as u32);
            if s.arming_floor() < s.floor {
                return Err(ConfigError::InvertedFloors { card, arming: s.arming_floor(), floor: s.floor });
            }
            if let Some(budget) = s.budget {
                if budget == Bytes::ZERO {
                    return Err(ConfigError::ZeroBudget { card, budget });
                }
            }
        }
        Ok(())
    }

    /// The settings of one card (defaults if the card is unknown).
    pub fn card(&self, card: CardId) -> CardSettings {
        self.cards.get(card.0 as usize).copied().unwrap_or_default()
    }
}

/// Parse `N[,N,...]` MiB counts.
pub fn parse_mib_list(flag: &'static str, text: &str) -> Result<Vec<u64>, ConfigError> {
    let bad = || ConfigError::BadList { flag, value: text.to_string() };
    let values: Result<Vec<u64>, _> = text.split(',').map(|v| v.trim().parse::<u64>()).collect();
    let values = values.map_err(|_| bad())?;
    if values.is_empty() {
        return Err(bad());
    }
    Ok(values)
}

fn spread_list(flag: &'static str, values: &[u64], cards: usize) -> Result<Vec<u64>, ConfigError> {
    match values.len() {
        1 => Ok(vec![values[0]; cards]),
        n if n == cards => Ok(values.to_vec()),
        n => Err(ConfigError::WrongCount { flag, given: n, cards }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_spread_or_match_card_count() {
        let c = GovernorConfig::from_flags(3, None, None).unwrap();
        assert!(c.cards.iter().all(|s| s.floor == DEFAULT_FLOOR && s.budget.is_none()));
        let c = GovernorConfig::from_flags(3, Some("512"), Some("1000,2000,3000")).unwrap();
        assert_eq!(c.cards[2].floor, Bytes::mib(512));
        assert_eq!(c.cards[1].budget, Some(Bytes::mib(2000)));
        assert!(matches!(
            GovernorConfig::from_flags(3, Some("1,2"), None),
            Err(ConfigError::WrongCount { .. })
        ));
        assert!(matches!(GovernorConfig::from_flags(1, Some("x"), None), Err(ConfigError::BadList { .. })));
        assert!(matches!(
            GovernorConfig::from_flags(1, None, Some("0")),
            Err(ConfigError::ZeroBudget { .. })
        ));
    }

    #[test]
    fn arming_floor_is_separate_from_the_law() {
        let s = CardSettings { arm_margin: Bytes::mib(512), ..CardSettings::default() };
        assert_eq!(s.floor, Bytes::mib(1024));
        assert_eq!(s.arming_floor(), Bytes::mib(1536));
    }
}
