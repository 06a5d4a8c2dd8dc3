//! `names!`: a closed set of names, written once — an enum whose variants each have the text the
//! API, the database and the logs use; `as_str`, `parse`, `ALL` (in order) and `Display`. Every
//! closed set of Settle is one, so the compiler lists them and one round-trip test covers each.

/// Defines a closed set of names: `names! { /// doc  Name { Variant = "text", … } }`.
#[macro_export]
macro_rules! names {
    ($(#[$meta:meta])* $vis:vis $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        $vis enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every name, in the order written.
            pub const ALL: [$name; [$($text),+].len()] = [$($name::$variant,)+];

            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }

            pub fn parse(s: &str) -> Option<$name> {
                $name::ALL.into_iter().find(|v| v.as_str() == s)
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.pad(self.as_str())
            }
        }
    };
}

#[cfg(test)]
mod tests {
    crate::names! {
        /// A set for the test.
        Colour {
            Red = "red",
            DeepBlue = "deep_blue",
        }
    }

    /// Every closed set of settle-core: each name parses back to itself, and no two share a text.
    #[test]
    fn every_closed_set_round_trips() {
        macro_rules! round_trip {
            ($($set:path),+) => {$({
                use $set as Set;
                let texts: std::collections::BTreeSet<&str> = Set::ALL.iter().map(|v| v.as_str()).collect();
                assert_eq!(texts.len(), Set::ALL.len(), "{}: two names share a text", stringify!($set));
                for v in Set::ALL {
                    assert_eq!(Set::parse(v.as_str()), Some(v), "{}", stringify!($set));
                    assert_eq!(v.to_string(), v.as_str());
                }
                assert_eq!(Set::parse("not-a-name"), None);
            })+};
        }
        round_trip!(
            crate::job::JobState,
            crate::job::RefundPolicy,
            crate::item::ItemState,
            crate::item::RefundReason,
            crate::ledger::EntryKind,
            crate::ledger::GrantOrigin,
            crate::ledger::AllocationKind,
            crate::history::EventKind,
            crate::history::AttemptResult,
            crate::history::Signal,
            crate::history::SignalEffect,
            crate::spend::Period
        );
    }

    #[test]
    fn names_round_trip_and_refuse_others() {
        assert_eq!(Colour::ALL, [Colour::Red, Colour::DeepBlue]);
        for c in Colour::ALL {
            assert_eq!(Colour::parse(c.as_str()), Some(c));
            assert_eq!(c.to_string(), c.as_str());
        }
        assert_eq!(Colour::parse("Red"), None);
        assert_eq!(Colour::parse(""), None);
    }
}
