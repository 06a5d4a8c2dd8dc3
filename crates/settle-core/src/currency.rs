//! ISO 4217: the currency codes a top-up's `price` may be in (spec §4a). A price is recorded in its
//! currency's minor units and never converted.

/// The active alphabetic codes of ISO 4217 (the list as published for 2025), sorted.
const ACTIVE: [&str; 154] = [
    "AED", "AFN", "ALL", "AMD", "AOA", "ARS", "AUD", "AWG", "AZN", "BAM", "BBD", "BDT", "BHD", "BIF", "BMD", "BND",
    "BOB", "BRL", "BSD", "BTN", "BWP", "BYN", "BZD", "CAD", "CDF", "CHF", "CLP", "CNY", "COP", "CRC", "CUP", "CVE",
    "CZK", "DJF", "DKK", "DOP", "DZD", "EGP", "ERN", "ETB", "EUR", "FJD", "FKP", "GBP", "GEL", "GHS", "GIP", "GMD",
    "GNF", "GTQ", "GYD", "HKD", "HNL", "HTG", "HUF", "IDR", "ILS", "INR", "IQD", "IRR", "ISK", "JMD", "JOD", "JPY",
    "KES", "KGS", "KHR", "KMF", "KPW", "KRW", "KWD", "KYD", "KZT", "LAK", "LBP", "LKR", "LRD", "LSL", "LYD", "MAD",
    "MDL", "MGA", "MKD", "MMK", "MNT", "MOP", "MRU", "MUR", "MVR", "MWK", "MXN", "MYR", "MZN", "NAD", "NGN", "NIO",
    "NOK", "NPR", "NZD", "OMR", "PAB", "PEN", "PGK", "PHP", "PKR", "PLN", "PYG", "QAR", "RON", "RSD", "RUB", "RWF",
    "SAR", "SBD", "SCR", "SDG", "SEK", "SGD", "SHP", "SLE", "SOS", "SRD", "SSP", "STN", "SVC", "SYP", "SZL", "THB",
    "TJS", "TMT", "TND", "TOP", "TRY", "TTD", "TWD", "TZS", "UAH", "UGX", "USD", "UYU", "UZS", "VED", "VES", "VND",
    "VUV", "WST", "XAF", "XCD", "XOF", "XPF", "YER", "ZAR", "ZMW", "ZWG",
];

/// An ISO 4217 code, upper-cased: `usd` and `USD` are one currency (so one fingerprint).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Currency(&'static str);

impl Currency {
    pub fn parse(s: &str) -> Option<Currency> {
        let upper = s.to_ascii_uppercase();
        ACTIVE.binary_search(&upper.as_str()).ok().map(|i| Currency(ACTIVE[i]))
    }

    pub const fn as_str(&self) -> &'static str {
        self.0
    }
}

impl std::fmt::Display for Currency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_is_sorted_unique_and_three_capitals_each() {
        assert!(ACTIVE.windows(2).all(|w| w[0] < w[1]));
        assert!(ACTIVE.iter().all(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase())));
    }

    #[test]
    fn codes_parse_in_either_case_and_nothing_else_does() {
        assert_eq!(Currency::parse("usd").map(|c| c.as_str()), Some("USD"));
        assert_eq!(Currency::parse("EUR").map(|c| c.as_str()), Some("EUR"));
        assert_eq!(Currency::parse("KRW").map(|c| c.to_string()), Some("KRW".to_owned()));
        for bad in ["", "US", "USDD", "XXX", "ABC", "us d", "€", "XAU"] {
            assert!(Currency::parse(bad).is_none(), "{bad}");
        }
    }
}
